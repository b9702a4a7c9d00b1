"""Where sf-train's time goes: the loop's own split (waiting for the next batch, the step) and,
with --profile-steps N, torch.profiler over N optimizer steps written to <output>/profile.txt.

The loop's split is host wall time. A step ends with its metrics read back to the host (one
synchronisation), so a step's host time covers its device work too; what the loop waits in
`next(loader)` is time the device sits idle unless the previous step's work is still queued.
Neither goes into the run's history: wall times differ between a resumed run and an
uninterrupted one, and the history must not.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfoundry.common.files import atomic_write_bytes

PROFILE_FILE = "profile.txt"
SKIPPED_STEPS = 2
"""Steps before the profiler starts: the first steps compile kernels and fill the loader's queue."""


class LoopClock:
    """Host seconds the loop spends waiting for batches and in steps, since the last report."""

    def __init__(self):
        self.data_s = self.step_s = 0.0
        self.steps = 0

    def add(self, data_s: float, step_s: float) -> None:
        """One optimizer step: the seconds it waited for its batches and the seconds it took."""
        self.data_s += data_s
        self.step_s += step_s
        self.steps += 1

    def report(self) -> str:
        """'data wait X ms, step Y ms a step' over the steps since the last report; then resets."""
        n = max(self.steps, 1)
        text = f"data wait {1e3 * self.data_s / n:,.0f} ms, step {1e3 * self.step_s / n:,.0f} ms a step"
        self.data_s = self.step_s = 0.0
        self.steps = 0
        return text


class StepProfiler:
    """torch.profiler over `steps` optimizer steps after SKIPPED_STEPS (and one profiler warm-up
    step); a context manager, `step()` after every optimizer step. When the window closes (or the
    context ends inside it), writes profile.txt in `out`: operators by device time (CUDA) and by
    host time. steps 0: does nothing."""

    def __init__(self, out: Path, steps: int, device: torch.device, write: bool = True):
        self.out, self.steps, self.write = Path(out), steps, write
        self.prof = None
        if steps <= 0:
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.cuda = device.type == "cuda"
        self.prof = profile(activities=activities, on_trace_ready=self._written,
                            schedule=schedule(skip_first=SKIPPED_STEPS, wait=0, warmup=1, active=steps, repeat=1))

    def __enter__(self) -> StepProfiler:
        if self.prof is not None:
            self.prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.prof is not None:
            self.prof.__exit__(*exc)

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def _written(self, prof) -> None:
        if not self.write:
            return
        events = prof.key_averages()
        parts = [f"sf-train profile: {self.steps} optimizer steps after the first {SKIPPED_STEPS + 1}\n"]
        if self.cuda:
            parts.append("== operators by device (CUDA) time ==\n"
                         + events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=80))
        parts.append("== operators by host time ==\n"
                     + events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=80))
        atomic_write_bytes(self.out / PROFILE_FILE, "\n".join(parts).encode())
