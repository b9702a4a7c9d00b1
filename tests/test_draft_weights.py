"""A draft's weights are checked finite wherever they are read (sf-export, sf-eval, the gate,
--init-from) and before sf-train writes them: a NaN is one line naming the file and the tensor,
never an export written or a decode run on it."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from specfoundry.families import FAMILIES
from specfoundry.families.folders import DraftLoadError, find_draft_files, load_draft, locate_draft
from tests.test_families import family_options, stub_featureset
from tests.test_reliability import features, tiny_cfg  # noqa: F401 - the feature set fixture


def poisoned_export(name: str, tiny_llama_dir, tmp_path):
    """An export of family `name` (a random draft of the tiny target) with one NaN in one weight;
    returns (the folder, the name of the poisoned tensor)."""
    family, options = FAMILIES.provider(name), family_options(name, tmp_path)
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
    family, options = FAMILIES.provider(name), family_options(name, tmp_path)
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
        trainer.unwrapped.draft.norm.weight[3] = float("inf")
    with pytest.raises(NonFiniteError, match=r"step 1: norm\.weight: 1 of \d+ values are not finite"):
        trainer.write_outputs()
    assert not (tmp_path / "run" / "export").exists() and not (tmp_path / "run" / ".export.tmp").exists()


def random_eagle3_export(tmp_path, tiny_llama_dir):
    """tmp_path/clean: a random EAGLE-3 draft of the tiny target exported (seed 0), as sf-export's source."""
    source = tmp_path / "clean"
    family, options = FAMILIES.provider("eagle3"), family_options("eagle3", tmp_path)
    layers = family.default_layers(8, options)
    torch.manual_seed(0)
    draft, dcfg = family.build(options, stub_featureset(tmp_path, tiny_llama_dir, layers), tiny_llama_dir, layers, None)
    family.export(draft.state_dict(), dcfg, source, {"num_layers": 8})
    return source


def test_sf_export_onto_a_full_disk_is_one_line_leaves_nothing_and_reruns_identically(tiny_llama_dir, tmp_path):
    """issue 37 item 9: a SafetensorError traceback and a temporary folder left behind, before."""
    import filecmp

    from specfoundry.train.cli import export_main
    from tests.test_faults import Tmpfs

    source = random_eagle3_export(tmp_path, tiny_llama_dir)
    argv = ["run", str(source), "--target", str(tiny_llama_dir), "--format", "speculators", "--verifier", "v"]
    reference = tmp_path / "reference"
    assert CliRunner().invoke(export_main, [*argv, "-o", str(reference)]).exit_code == 0
    disk = Tmpfs(tmp_path / "small", 1 << 20)  # the export's weights alone are several MB
    try:
        result = CliRunner().invoke(export_main, [*argv, "-o", str(disk.path / "export")])
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert result.exit_code == 2 and len(errors) == 1 and "No space left on device" in errors[0], result.output
        assert str(disk.path) in errors[0] and "Traceback" not in result.output
        assert list(disk.path.iterdir()) == []  # nothing left behind, the temporary folder included
        disk.grow(64 << 20)
        assert CliRunner().invoke(export_main, [*argv, "-o", str(disk.path / "export")]).exit_code == 0
        names = sorted(p.name for p in reference.iterdir())
        assert names == sorted(p.name for p in (disk.path / "export").iterdir())
        files = [n for n in names if n != "export_config.json"]  # which records its own output folder
        same, differ, _ = filecmp.cmpfiles(reference, disk.path / "export", files, shallow=False)
        assert differ == [] and same == files
    finally:
        disk.unmount()


@pytest.mark.parametrize(("vocab_size", "words"), [(1000, "mask_token_id 49151 is not below vocab_size 1000"),
                                                    (60000, "vocab_size 60000, the target's vocabulary 49152")])
def test_an_edited_vocab_size_names_the_field_and_both_values(tiny_llama_dir, tmp_path, vocab_size, words):
    """issue 37 item 10: it said 'outside the target vocabulary of 1000', 1000 being the edited field."""
    import json

    family, options = FAMILIES.provider("dflash"), family_options("dflash", tmp_path)
    layers = family.default_layers(8, options)
    torch.manual_seed(0)
    draft, dcfg = family.build(options, stub_featureset(tmp_path, tiny_llama_dir, layers), tiny_llama_dir, layers, None)
    out = family.export(draft.state_dict(), dcfg, tmp_path / "export", {"num_layers": 8})
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] = vocab_size
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftLoadError) as e:
        load_draft(locate_draft(out), tiny_llama_dir, torch.device("cpu"), torch.float32)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_draft_vocabulary_holding_none_of_the_sets_tokens_is_refused(features, tmp_path):  # noqa: F811
    """issue 37 item 5: EAGLE-3 trained 'successfully' with every loss exactly 0.0. Before training
    sf-train says what share of the supervised tokens the vocabulary holds, and refuses none."""
    from specfoundry.families.eagle3.export import export_draft
    from specfoundry.families.folders import find_draft_files
    from specfoundry.families.vocab import vocab_maps
    from specfoundry.featureset.manifest import FeatureSetError
    from specfoundry.train.trainer import run_train

    first = run_train(tiny_cfg(features, tmp_path / "first", max_steps=1), silent=True)
    cfg, tensors = find_draft_files(locate_draft(first["export"]))
    unseen = torch.arange(40000, 40000 + cfg.draft_vocab_size)  # ids the set's answers never use
    tensors["d2t"], tensors["t2d"] = vocab_maps(unseen, cfg.vocab_size)
    foreign = export_draft(tensors, cfg, tmp_path / "foreign", None)
    with pytest.raises(FeatureSetError, match=r"vocabulary holds none of feature set .* supervised tokens"):
        run_train(tiny_cfg(features, tmp_path / "second", max_steps=1, init_from=str(foreign)), silent=True)
    assert not (tmp_path / "second" / "export").exists()


def test_a_micro_batch_with_nothing_to_learn_is_skipped_and_counted(features, tmp_path):  # noqa: F811
    """issue 37 item 5: P-EAGLE died at step 1 (`element 0 of tensors does not require grad`) on a
    micro-batch whose supervised tokens all fall outside its draft vocabulary (here: a vocabulary of
    the one most frequent token, single-sample batches)."""
    from specfoundry.train.trainer import run_train

    result = run_train(tiny_cfg(features, tmp_path / "run", family="peagle", peagle_vocab_size=1, max_steps=6,
                                max_batch_tokens=64), silent=True)
    assert result["steps"] == 6 and result["history"][-1]["skipped_micro_batches"] >= 1


def test_two_exports_into_one_folder_and_an_export_onto_a_link(tiny_llama_dir, tmp_path):
    """issue 61 item 9: two sf-export runs into one folder at once lost the export in 4 of 10 trials
    (one exited 0 saying 'wrote' with only a hidden .old there), and -o onto a symbolic link to a
    folder replaced the link with a folder. The second run is now refused in one line while the first
    holds the folder, and a link's folder is written through it."""
    from filelock import FileLock

    from specfoundry.train.cli import export_main

    source = random_eagle3_export(tmp_path, tiny_llama_dir)
    argv = ["run", str(source), "--target", str(tiny_llama_dir)]
    out = tmp_path / "out"
    with FileLock(str(tmp_path / ".out.lock"), timeout=0):  # a first run, mid-write
        result = CliRunner().invoke(export_main, [*argv, "-o", str(out)])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and len(errors) == 1 and "another sf-export run is writing it" in errors[0], \
        result.output
    assert not out.exists()
    (tmp_path / ".out.lock").unlink()  # (the stand-in first run's lock file)
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real, target_is_directory=True)
    assert CliRunner().invoke(export_main, [*argv, "-o", str(link)]).exit_code == 0
    assert link.is_symlink() and (real / "config.json").is_file() and (real / "model.safetensors").is_file()
    litter = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert litter == [], litter
    here = tmp_path / "here"  # issue 61 item 11: '-o .' said "PosixPath('.') has an empty name"
    here.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(here)
        result = CliRunner().invoke(export_main, [*argv, "-o", "."])
    assert result.exit_code == 0 and (here / "model.safetensors").is_file(), result.output
