"""A draft's weights are checked finite wherever they are read (sf-export, sf-eval, the gate,
--init-from) and before sf-train writes them: a NaN is one line naming the file and the tensor,
never an export written or a decode run on it."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from specfoundry.families import FAMILIES, get_family
from specfoundry.families.folders import DraftLoadError, find_draft_files, load_draft, locate_draft
from tests.test_families import family_options, stub_featureset
from tests.test_reliability import features, tiny_cfg  # noqa: F401 - the feature set fixture


def poisoned_export(name: str, tiny_llama_dir, tmp_path):
    """An export of family `name` (a random draft of the tiny target) with one NaN in one weight;
    returns (the folder, the name of the poisoned tensor)."""
    family, options = get_family(name), family_options(name, tmp_path)
    layers = family.default_layers(8, options)
    torch.manual_seed(0)
    draft, dcfg = family.build(options, stub_featureset(tmp_path, tiny_llama_dir, layers), tiny_llama_dir, layers, None)
    out = family.export(draft.state_dict(), dcfg, tmp_path / "export", {"num_layers": 8})
    tensors = load_file(str(out / "model.safetensors"))
    poisoned = next(k for k, t in sorted(tensors.items()) if t.is_floating_point() and t.numel() > 1)
    tensors[poisoned][(0,) * tensors[poisoned].dim()] = float("nan")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, poisoned


@pytest.mark.parametrize("name", FAMILIES.names())
def test_a_nan_in_an_exported_weight_is_refused_by_every_reader(name, tiny_llama_dir, tmp_path):
    from specfoundry.train.cli import export_main

    out, poisoned = poisoned_export(name, tiny_llama_dir, tmp_path)
    words = [str(out / "model.safetensors"), poisoned, "not finite"]
    for read in (lambda: find_draft_files(locate_draft(out, 8)),  # sf-export's and the gate's reading
                 lambda: load_draft(locate_draft(out), tiny_llama_dir, torch.device("cpu"), torch.float32)):  # sf-eval
        with pytest.raises(DraftLoadError) as e:
            read()
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    family, options = get_family(name), family_options(name, tmp_path)
    layers = family.default_layers(8, options)
    with pytest.raises(DraftLoadError, match="not finite"):  # --init-from
        family.build(options, stub_featureset(tmp_path, tiny_llama_dir, layers), tiny_llama_dir, layers, str(out))
    layout = FAMILIES.get(name).layouts[0]
    result = CliRunner().invoke(export_main, ["run", str(out), "-o", str(tmp_path / "again"), "--format", layout,
                                              "--target", str(tiny_llama_dir)])
    assert result.exit_code == 2 and poisoned in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "again").exists()


def test_sf_train_refuses_to_export_non_finite_weights(features, tmp_path):  # noqa: F811 - the fixture
    """Weights that turned non-finite with a finite loss (a weight the last step's loss did not
    read): finish() refuses, naming the tensor, and writes no export."""
    from specfoundry.train.trainer import NonFiniteError, Trainer

    trainer = Trainer(tiny_cfg(features, tmp_path / "run", max_steps=1), silent=True).build()
    trainer.resume()
    trainer.train_step([next(iter(trainer.loader))])
    with torch.no_grad():
        trainer.raw.draft.norm.weight[3] = float("inf")
    with pytest.raises(NonFiniteError, match=r"draft\.norm\.weight: 1 of \d+ values are not finite"):
        trainer.finish()
    assert not (tmp_path / "run" / "export").exists() and not (tmp_path / "run" / ".export.tmp").exists()
