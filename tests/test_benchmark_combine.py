"""benchmarks/combine.py: figures of separate runs in one result file, each with its source."""

import json

import pytest

from benchmarks.combine import combine


def write(path, obj):
    path.write_text(json.dumps(obj))
    return path


@pytest.fixture
def runs(tmp_path):
    small = write(tmp_path / "small.json", {"commit": "aaa", "command": "bench --shapes small", "machine": {"gpu": "G"},
                                            "date": "d1", "summary": {"ms": {"small": {"token": {"core": 1.5}}}}})
    big = write(tmp_path / "big.json", {"commit": "bbb", "command": "bench --shapes big", "machine": {"gpu": "G"},
                                        "date": "d2", "summary": {"ms": {"big": {"token": {"core": 7.0}}}}})
    return tmp_path, small, big


def test_combined_figures_carry_their_sources_and_a_rerun_changes_nothing(runs):
    tmp_path, small, big = runs
    specs = [f"summary.ms.small={small}:summary.ms.small", f"summary.ms.big={big}:summary.ms.big"]
    out = combine(str(tmp_path / "all.json"), specs)
    first = json.loads(out.read_text())
    assert first["summary"]["ms"] == {"small": {"token": {"core": 1.5}}, "big": {"token": {"core": 7.0}}}
    assert first["sources"]["summary.ms.big"] == {"file": "big.json", "key": "summary.ms.big", "commit": "bbb",
                                                  "command": "bench --shapes big", "machine": {"gpu": "G"},
                                                  "date": "d2"}
    assert "machine" not in first and "commit" not in first  # each figure's are in its source
    combine(str(out), specs)
    again = json.loads(out.read_text())
    assert {k: v for k, v in again.items() if k != "combined"} == {k: v for k, v in first.items() if k != "combined"}


def test_a_figure_of_the_files_own_run_is_never_overwritten(runs):
    tmp_path, small, _ = runs
    own = write(tmp_path / "own.json", {"commit": "ccc", "summary": {"ms": {"small": {"token": {"core": 9.9}}}}})
    with pytest.raises(SystemExit, match="figure of its own run"):
        combine(str(own), [f"summary.ms.small={small}:summary.ms.small"])
    assert json.loads(own.read_text())["summary"]["ms"]["small"]["token"]["core"] == 9.9
    # beside its own figures, a new key is added
    combine(str(own), [f"summary.ms.other={small}:summary.ms.small"])
    assert json.loads(own.read_text())["summary"]["ms"]["small"]["token"]["core"] == 9.9
    # an own figure that a source happens to equal stays its own: a later, different source is refused
    same = write(tmp_path / "same.json", {"commit": "ddd", "figure": 9.9})
    combine(str(own), [f"summary.ms.small.token.core={same}:figure"])
    assert "summary.ms.small.token.core" not in json.loads(own.read_text())["sources"]
    with pytest.raises(SystemExit, match="figure of its own run"):
        combine(str(own), [f"summary.ms.small.token.core={small}:summary.ms.small.token.core"])


def test_a_table_and_its_parts_are_not_both_combined(runs):
    tmp_path, small, big = runs
    out = str(tmp_path / "all.json")
    combine(out, [f"summary.ms.small={small}:summary.ms.small"])
    for key in ("summary.ms.small.token", "summary.ms"):  # below and above the combined table
        with pytest.raises(SystemExit, match="overlaps 'summary.ms.small'"):
            combine(out, [f"{key}={big}:summary.ms.big"])
    assert json.loads((tmp_path / "all.json").read_text())["summary"]["ms"] == {"small": {"token": {"core": 1.5}}}


@pytest.mark.parametrize("specs, message", [(["summary.ms.x"], "expected KEY=FILE:SRCKEY"),
                                            (["k={small}:summary.ms.nothing"], "no key 'summary.ms.nothing'"),
                                            (["k={missing}:summary"], "does not exist"),
                                            (["k={small}:summary", "k={big}:summary"], "given twice"),
                                            (["k={combined}:summary"], "no commit of its own")])
def test_a_bad_spec_is_named(runs, specs, message):
    tmp_path, small, big = runs
    combined = write(tmp_path / "combined.json", {"summary": {"x": 1}, "sources": {"summary.x": {}}})
    specs = [spec.format(small=small, big=big, missing=tmp_path / "missing.json", combined=combined) for spec in specs]
    with pytest.raises(SystemExit, match=message):
        combine(str(tmp_path / "all.json"), specs)
    assert not (tmp_path / "all.json").exists()
