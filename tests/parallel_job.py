"""Every stage that runs the target, with --tp / --ep, in one torchrun launch (tests/test_parallel.py).

    torchrun --nproc-per-node N -m tests.parallel_job SOURCE PLAN.json

PLAN is a list of jobs {"target", "work", "tp", "ep", "stages", "source" (SOURCE unless given)}, run
one after the other in the same processes (the launch's process groups are made once; each stage
loads and places its own target), through the stages' library calls as their commands make them (the
commands are thin wrappers; test_parallel.py also runs sf-capture itself under torchrun): capture
(float32 storage, so the test can compare the arithmetic), greedy regen (float32), the gate (which
trains its draft in a child process), and sf-eval on the gate's export. Each writes into
WORK/<stage>.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specfoundry.capture.stage import CaptureConfig, run_capture
from specfoundry.common.placement import Placement
from specfoundry.eval.evaluate import EvalConfig, run_eval
from specfoundry.gate import GateConfig, run_gate
from specfoundry.generate.backends.interface import SamplingConfig
from specfoundry.generate.regen import RegenConfig, run_regen

STAGES = ("capture", "regen", "gate", "eval")


def capture_config(target: str, source: str, out: Path, placement: Placement) -> CaptureConfig:
    return CaptureConfig(source=source, output=str(out), target=target, storage_dtype="float32", codec="safetensors",
                         shard_size=2, max_length=96, device="cpu", placement=placement)


def regen_config(target: str, source: str, out: Path, placement: Placement) -> RegenConfig:
    return RegenConfig(source=source, output=str(out), target=target, batch_size=4, shard_size=2, device="cpu",
                       sampling=SamplingConfig(temperature=0.0, max_new_tokens=12), placement=placement)


def gate_config(target: str, out: Path, placement: Placement) -> GateConfig:
    return GateConfig(output=str(out), target=target, max_steps=60, max_new_tokens=32, device="cpu",
                      placement=placement)


def eval_config(target: str, draft: Path, placement: Placement, out: Path | None = None) -> EvalConfig:
    return EvalConfig(draft=str(draft), target=target, output=str(out) if out else None, prompt_sets=("chat",),
                      limit=2, k=3, max_new_tokens=16, device="cpu", dtype="float32", placement=placement)


def run_job(source: str, target: str, work: Path, placement: Placement, stages: list[str]) -> None:
    if "capture" in stages:
        run_capture(capture_config(target, source, work / "capture", placement), silent=True)
    if "regen" in stages:
        run_regen(regen_config(target, source, work / "regen", placement), silent=True)
    if "gate" in stages:
        _, ok, message = run_gate(gate_config(target, work / "gate", placement))
        if not ok:
            sys.exit(f"gate: {message}")
    if "eval" in stages:
        run_eval(eval_config(target, work / "gate" / "train" / "export", placement, work / "eval"), silent=True)


def main(argv=None) -> None:
    source, plan = (argv or sys.argv[1:])[:2]
    for job in json.loads(Path(plan).read_text()):
        placement = Placement(tp=job.get("tp", 1), ep=job.get("ep", 1),
                              experts_implementation=job.get("experts_implementation", "auto"))
        run_job(job.get("source", source), job["target"], Path(job["work"]), placement, job.get("stages", list(STAGES)))


if __name__ == "__main__":
    main()
