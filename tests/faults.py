"""Run a specfoundry command and SIGKILL it at a chosen moment (the fault-matrix tests' helper).

    python tests/faults.py --kill-at MOMENT --match GLOB [--nth N] -- MODULE ARGS...

installs one patch in this process, then runs MODULE as `python -m MODULE ARGS...` would
(runpy), so the command is the real one, in a real process, killed for real. MOMENT:

- `before-rename` / `after-rename`: the N-th os.replace / os.rename (Path.rename and
  Path.replace go through them) whose destination path matches GLOB (fnmatch on the whole path)
  kills the process just before, or just after, it happens;
- `mid-write`: the N-th torch.save or safetensors.torch.save_file whose file path matches GLOB
  writes its file, cuts it to half its size and kills the process: a file half written.

Nothing is patched in the library's files: the patches live in this process only, installed
before the command's modules are imported (so `from safetensors.torch import save_file` binds
the patched function). A kill that never happens leaves the command to finish normally; the
tests check the exit status (-SIGKILL) to know the moment was reached. The moment reached is
also announced on stderr as `faults: killed at ...`.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import runpy
import signal
import sys
import threading

MOMENTS = ("before-rename", "after-rename", "mid-write")


def die(what: str) -> None:
    sys.stderr.write(f"faults: killed at {what}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Trigger:
    """Counts the calls whose path matches `pattern`; the `nth` one fires."""

    def __init__(self, pattern: str, nth: int):
        self.pattern, self.nth, self.seen = pattern, nth, 0
        self.lock = threading.Lock()  # capture renames shards from writer threads

    def fires(self, path) -> bool:
        if not isinstance(path, (str, os.PathLike)) or not fnmatch.fnmatch(os.fspath(path), self.pattern):
            return False
        with self.lock:
            self.seen += 1
            return self.seen == self.nth


def patch_renames(trigger: Trigger, after: bool) -> None:
    for name in ("replace", "rename"):
        original = getattr(os, name)

        def wrapped(src, dst, *args, _original=original, _name=name, **kwargs):
            fire = trigger.fires(dst)
            if fire and not after:
                die(f"before os.{_name}({src} -> {dst})")
            result = _original(src, dst, *args, **kwargs)
            if fire:
                die(f"after os.{_name}({src} -> {dst})")
            return result

        setattr(os, name, wrapped)


def half_written(path, what: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
        f.flush()
        os.fsync(f.fileno())
    die(f"{what}({path}) with {size // 2} of {size} bytes written")


def patch_writes(trigger: Trigger) -> None:
    import safetensors.torch
    import torch

    def half_writing(write, what: str):
        """`write(obj, path, ...)` that, when the trigger fires on `path`, leaves the file half written."""

        def wrapper(obj, path, *args, **kwargs):
            fire = trigger.fires(path)
            result = write(obj, path, *args, **kwargs)
            if fire:
                half_written(path, what)
            return result

        return wrapper

    torch.save = half_writing(torch.save, "torch.save")
    safetensors.torch.save_file = half_writing(safetensors.torch.save_file, "safetensors save_file")


def main(argv: list[str]) -> None:
    if "--" not in argv:
        raise SystemExit("usage: faults.py --kill-at MOMENT --match GLOB [--nth N] -- MODULE ARGS...")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="faults.py")
    parser.add_argument("--kill-at", choices=MOMENTS, required=True)
    parser.add_argument("--match", required=True, help="fnmatch pattern over the whole destination/file path")
    parser.add_argument("--nth", type=int, default=1, help="kill at the N-th matching call")
    opts = parser.parse_args(argv[:split])
    module, *args = argv[split + 1:]
    trigger = Trigger(opts.match, opts.nth)
    if opts.kill_at == "mid-write":
        patch_writes(trigger)
    else:
        patch_renames(trigger, after=opts.kill_at == "after-rename")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
