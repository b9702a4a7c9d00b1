"""sf-train's checkpoints: step-N is complete by construction, step-N.tmp is one being written.

A checkpoint is accelerate's state (weights, optimizer, scheduler, RNG) plus trainer_state.json
(the step, each rank's loader position, the history) and a copy of the run's config, written
into step-N.tmp and renamed once whole; resume trusts only such complete checkpoints
(families/folders.py names them: complete_checkpoints) and removes leftovers, naming them.
"""

from __future__ import annotations

import errno
import json
import shutil
import sys
from pathlib import Path

from specfoundry.common.files import TMP_SUFFIX, atomic_write_json, disk_full, replace_dir, write_dir_whole
from specfoundry.families.folders import TRAINER_STATE, complete_checkpoints, incomplete_checkpoints


def save_state(accel, path: Path) -> None:
    """accelerate's save_state, with a full disk reported as the OSError it is (common/files.py disk_full)."""
    try:
        accel.save_state(str(path))
    except Exception as e:
        full = disk_full(e, path)
        if full is None and shutil.disk_usage(path if path.exists() else path.parent).free < (1 << 20):
            full = OSError(errno.ENOSPC, "No space left on device", str(path))  # a message that does not say so
        if full is None:
            raise
        raise full from e


def newest_complete_checkpoint(accel, out: Path) -> Path | None:
    """The checkpoint a resume continues from (None: none is complete). The main process names
    incomplete ones (a step-N.tmp, a step-N without trainer_state.json) in one line and removes them."""
    complete = complete_checkpoints(out)
    if accel.is_main_process:
        leftovers = incomplete_checkpoints(out)
        if leftovers:
            start = f"resuming from {complete[-1].name}" if complete else "starting from step 0"
            print(f"sf-train: incomplete checkpoint {', '.join(p.name for p in leftovers)} "
                  f"(no {TRAINER_STATE} or never renamed into place) removed; {start}", file=sys.stderr)
        for p in leftovers:
            shutil.rmtree(p, ignore_errors=True)
    accel.wait_for_everyone()
    return complete[-1] if complete else None


RNG_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")
RANDOM_STATES = "random_states_{rank}.pkl"
"""A checkpoint's RNG file of each rank (accelerate's save_state: one a process)."""


def check_process_count(checkpoint: Path, processes: int) -> None:
    """A checkpoint is resumed by as many processes as saved it (each rank's data position and RNG are
    its own): another count is one line naming both, not a damaged checkpoint."""
    saved = len(list(checkpoint.glob(RANDOM_STATES.format(rank="*"))))
    if saved and saved != processes:
        raise ValueError(f"{checkpoint} was saved by {saved} processes and this launch has {processes}: "
                         f"resume with {saved}, or train into a new folder")


def check_random_states(checkpoint: Path, processes: int) -> None:
    """Every rank's RNG file of a checkpoint loads and holds the generators' states. accelerate's
    load_state skips a missing or damaged one without a word, and the resumed run then draws other
    random numbers than an uninterrupted one would (its dropout, its shuffles). Each rank checks all
    of them, so that a damaged one stops every rank alike rather than leaving the others waiting."""
    from accelerate.utils import load

    for rank in range(processes):
        path = checkpoint / RANDOM_STATES.format(rank=rank)
        if not path.is_file():
            raise OSError(f"{path.name} is missing")
        states = load(path)
        missing = [k for k in RNG_KEYS if k not in states]
        if missing:
            raise ValueError(f"{path.name} lacks {', '.join(missing)}")


def read_trainer_state(checkpoint: Path) -> dict:
    """{step, loader: one state per rank, history} of a complete checkpoint; a file that is not JSON
    is one line naming it."""
    path = checkpoint / TRAINER_STATE
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e}): the checkpoint is damaged; remove {checkpoint} to resume from "
                         "the one before it") from None


def write_checkpoint(accel, out: Path, step: int, loader_state: dict, record: dict, keep_last: int) -> Path:
    """Write out/checkpoints/step-N: accelerate's state (every rank), then from the main process the
    run's config (record["train_config"]: the checkpoint stays resumable if train_config.json is
    lost) and trainer_state.json (the step, every rank's loader state, record["history"], and
    record["featureset_sha256"], the identity of the data it was trained on, which a resume compares) into
    step-N.tmp, then one rename; then drop all but the newest keep_last complete checkpoints."""
    final = out / "checkpoints" / f"step-{step:07d}"
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if accel.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accel.wait_for_everyone()
    save_state(accel, tmp)
    states = [None] * accel.num_processes
    if accel.num_processes > 1:  # a collective: every rank has finished its save_state after it
        import torch.distributed as dist

        dist.all_gather_object(states, loader_state)
    else:
        states = [loader_state]
    if accel.is_main_process:
        atomic_write_json(tmp / "train_config.json", record["train_config"])
        atomic_write_json(tmp / TRAINER_STATE, {"step": step, "loader": states, "history": record["history"],
                                                "featureset_sha256": record.get("featureset_sha256")})
        replace_dir(tmp, final)
        if keep_last > 0:
            for old in complete_checkpoints(out)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accel.wait_for_everyone()
    return final


# ---- --keep-best: the draft of the best held-out evaluation so far ----------------------------------

BEST = "best"
"""<run>/best/: draft.safetensors (the draft's weights by their export names) and best.json
({step, eval_sim_accept_len}), replaced whole each time a later evaluation beats it."""


def read_best(out: Path) -> dict | None:
    """best.json of the run's kept draft, or None where none is kept yet."""
    path = Path(out) / BEST / "best.json"
    return json.loads(path.read_text()) if path.is_file() else None


def read_best_state(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(out) / BEST / "draft.safetensors"))


def write_best(out: Path, state: dict, meta: dict) -> None:
    """Write best/ aside and rename it into place: a kill leaves the earlier best whole."""
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp / "draft.safetensors"))
        atomic_write_json(tmp / "best.json", meta)

    write_dir_whole(Path(out) / BEST, fill)

