"""--max-memory and --device-map given wrongly are one line each, in every command that places a
target, before anything loads (issue 37 item 8: they were Python tracebacks)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from specfoundry.common.placement import parse_max_memory
from tests.test_cli_help import COMMANDS

PLACING = {"sf-regen run": ["--synthesize", "1"], "sf-capture run": ["IN"], "sf-eval run": ["IN"], "sf-eval gate": []}
BAD = [(["--device-map", "auto", "--max-memory", "cpu=abc"], "'abc' is not a size"),
       (["--device-map", "auto", "--max-memory", "cpu=-5GiB"], "'-5GiB' is not a size"),
       (["--device-map", "auto", "--max-memory", "cpu=10XB"], "'10XB' is not a size"),
       (["--max-memory", "cpu=10GiB"], "give --device-map auto too"),
       (["--device-map", "auto", "--max-memory", "7=10GiB"], "no GPU 7")]


@pytest.mark.parametrize("path", list(PLACING))
@pytest.mark.parametrize(("argv", "words"), BAD, ids=[b[1] for b in BAD])
def test_a_bad_placement_option_is_one_line_before_anything_loads(tmp_path, path, argv, words):
    command, sub = path.split()
    given = [str(tmp_path / "in") if a == "IN" else a for a in PLACING[path]]
    result = CliRunner().invoke(COMMANDS[command], [sub, *given, "-o", str(tmp_path / "out"), *argv])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and len(errors) == 1 and words in errors[0], (result.output, result.exception)
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_sizes_are_read_as_accelerate_reads_them():
    gpus = torch.cuda.device_count()
    assert parse_max_memory("cpu=200GiB,disk=500GB") == {"cpu": 200 * 2**30, "disk": 500 * 10**9}
    assert parse_max_memory({"cpu": "512MiB"}) == {"cpu": 512 * 2**20}
    assert parse_max_memory(f"cpu={2**30}") == {"cpu": 2**30}
    with pytest.raises(ValueError, match=f"no GPU {gpus}"):
        parse_max_memory(f"{gpus}=1GiB")
