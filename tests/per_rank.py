"""Run a command under torchrun with arguments that differ by rank (the launch checks' tests):

    torchrun --nproc-per-node 2 tests/per_rank.py specfoundry.capture.cli run SRC ... --tp "r0=2|r1=1"

An argument "r0=A|r1=B" becomes A on rank 0 and B on rank 1. OTHER_WEIGHTS_ON_RANK=r makes rank r
fingerprint the target's weights differently, as a second host holding another copy at the same path
would."""

from __future__ import annotations

import os
import runpy
import sys


def chosen(arg: str, rank: int) -> str:
    if "|" not in arg or not arg.startswith("r0="):
        return arg
    return dict(part.split("=", 1) for part in arg.split("|"))[f"r{rank}"]


def main() -> None:
    rank = int(os.environ.get("RANK", 0))
    if os.environ.get("OTHER_WEIGHTS_ON_RANK") == str(rank):
        import specfoundry.common.weights as weights

        real = weights.weight_fingerprint
        weights.weight_fingerprint = lambda *a, **k: real(*a, **k) + "-another-copy"
    module, *args = sys.argv[1:]
    sys.argv = [module, *(chosen(a, rank) for a in args)]
    runpy.run_module(module, run_name="__main__")


if __name__ == "__main__":
    main()
