"""Run a command under torchrun with arguments that differ by rank (the launch checks' tests):

    torchrun --nproc-per-node 2 tests/per_rank.py specfoundry.capture.cli run SRC ... --tp "r0=2|r1=1"

An argument "r0=A|r1=B" becomes A on rank 0 and B on rank 1. OTHER_WEIGHTS_ON_RANK=r makes rank r
fingerprint the target's weights differently, as a second host holding another copy at the same path
would; OTHER_DATA_ON_RANK=r makes rank r read other data at the same paths, as a second host's stale
copy would: sf-capture's planned samples in another order, and another feature set's manifest."""

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
    if os.environ.get("OTHER_DATA_ON_RANK") == str(rank):
        import specfoundry.capture.stage as stage
        import specfoundry.featureset.manifest as manifest

        real_plan, real_sha = stage.plan_capture, manifest.manifest_sha256

        def other_plan(*args, **kwargs):
            plan = real_plan(*args, **kwargs)
            plan.samples = plan.samples[::-1]
            return plan

        stage.plan_capture = other_plan
        manifest.manifest_sha256 = lambda root: f"{real_sha(root)}-another-copy"
    module, *args = sys.argv[1:]
    sys.argv = [module, *(chosen(a, rank) for a in args)]
    runpy.run_module(module, run_name="__main__")


if __name__ == "__main__":
    main()
