"""Shared benchmark helpers: CUDA-event timing after warm-up, peak memory, JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
MATMUL_TFLOPS = 790.0  # bf16 8192^3 matmul measured on the device's H200 (KINDS.md)
COPY_TBPS = 4.3  # device-to-device copy, bytes read + written (KINDS.md)


def cuda_time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median of `iters` CUDA-event timings of fn() after `warmup` calls."""
    return cuda_time_ms_interleaved({"fn": fn}, warmup, iters)["fn"]


def cuda_time_ms_interleaved(fns: dict, warmup: int = 3, iters: int = 15) -> dict:
    """Median CUDA-event time of each fn, the fns run in turn within every iteration, so that a
    drift of the card's clock during the run (seen as +-10% between runs of the same kernel)
    falls on all of them alike and their ratio stays fair."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def peak_memory_gib(fn) -> float:
    """Peak allocated memory during one fn() call, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def wall(fn) -> float:
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def machine() -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpus"] = torch.cuda.device_count()
    return info


def commit() -> str:
    """The code's commit: GIT_COMMIT when set (the device's copy of the tree has no .git), else git's."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(name: str, rows: list[dict], extra: dict | None = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "command": " ".join(sys.argv), "commit": commit(), "machine": machine(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows, **(extra or {})}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-+-".join("-" * widths[c] for c in columns))
    for r in rows:
        print(" | ".join(fmt(r.get(c)).ljust(widths[c]) for c in columns))


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "" if v is None else str(v)
