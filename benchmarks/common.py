"""Shared benchmark helpers: CUDA-event timing after warm-up, peak memory, JSON results with
their provenance (commit, machine, versions, command, date).

Every benchmark runs from the repository root as `python -m benchmarks.<name>`; shared model
shapes and random feature sets come from specfoundry.testing."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# the reference GPU's (one H200) measured rates: the denominators of MFU and of bandwidth shares
MATMUL_TFLOPS = 790.0  # bf16 8192^3 matmul
COPY_TBPS = 4.3  # device-to-device copy, bytes read + written


def cuda_time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median of `iters` CUDA-event timings of fn() after `warmup` calls."""
    return cuda_time_ms_interleaved({"fn": fn}, warmup, iters)["fn"]


def cuda_time_ms_interleaved(fns: dict, warmup: int = 3, iters: int = 15, host_ms: dict | None = None) -> dict:
    """Median CUDA-event time of each fn, the fns run in turn within every iteration, so that a
    drift of the card's clock during the run (seen as +-10% between runs of the same kernel)
    falls on all of them alike and their ratio stays fair. `host_ms`, if given, gets each fn's
    median host time: from the call until it returns, the device idle at the call."""
    import torch

    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    host = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            fn()
            host[name].append(1e3 * (time.perf_counter() - t))
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    if host_ms is not None:
        host_ms.update({name: statistics.median(t) for name, t in host.items()})
    return {name: statistics.median(t) for name, t in times.items()}


def call_ms(fn, cuda: bool | None = None) -> float:
    """One call of fn, in ms: CUDA-event device time between synchronisations on a GPU (`cuda`:
    whether fn runs on one; default: whether one is there), the host's time elsewhere."""
    import torch

    if not (torch.cuda.is_available() if cuda is None else cuda):
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def cuda_time_ms_back_to_back(fn, calls: int = 10, repeats: int = 5) -> float:
    """fn's CUDA-event time per call with `calls` calls enqueued back to back (no synchronisation
    between them; after one warm-up call), the median of `repeats`: the device's time per call when
    the host runs ahead. cuda_time_ms_interleaved synchronises after each call, so its figure also
    holds whatever part of the host's launch the device waits for."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def peak_memory_gib(fn) -> float:
    """Peak allocated memory during one fn() call, above what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def wall(fn) -> float:
    import torch

    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def machine() -> dict:
    """The versions (from the installed packages' metadata, nothing imported for them) and, where
    this process has used torch, its GPU: a benchmark that only gathers reports into a table never
    imports torch, and records no GPU of its own."""
    from importlib.metadata import PackageNotFoundError, version

    info = {"python": sys.version.split()[0], "platform": platform.platform()}
    for package in ("torch", "triton", "transformers"):
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__  # the build loaded (another may sit beside it in metadata)
    if torch is not None and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpus"] = torch.cuda.device_count()
    return info


def commit() -> str:
    """The code's commit: GIT_COMMIT when set (for a copy of the tree without .git), else git's."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command() -> str:
    """The command line as it was typed: `python -m benchmarks.<name> args` for a module run."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([head, *sys.argv[1:]])


def reports_environment(*runs: Path, reports: str = "eval_*/eval.json") -> dict | None:
    """The environment (python, torch, gpu) that the first of the gathered sf-eval reports records
    (`reports`: their paths in each run, a glob): where a gathered table's figures were measured,
    which may be another machine than the one gathering them; None where no report records one."""
    for run in runs:
        for report in sorted(Path(run).glob(reports)):
            environment = json.loads(report.read_text()).get("environment")
            if environment:
                return environment
    return None


def write_result(name: str, rows: list[dict], extra: dict | None = None, measured_on: dict | None = None) -> Path:
    """results/<name>.json: the rows with the commit, machine and versions, command and date; a
    new run replaces the file (git keeps the old one). `name` may end in .json and may be a path
    (absolute, or relative to results/). `measured_on`: the machine of the figures where this
    process only gathers them (reports_environment), else this one's."""
    name = name.removesuffix(".json")
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": Path(name).name, "command": command(), "commit": commit(),
               "machine": measured_on or machine(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows, **(extra or {})}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


KERNEL_KINDS = (  # (kind, substrings of a kernel name, lowercase): the first match names the kind
    ("memcpy / memset", ("memcpy", "memset")),
    ("attention", ("flex_attention", "flash", "fmha", "attention", "sdpa", "scaled_dot_product", "triton_tem")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "sm80_", "cublas", "matmul", "splitk", "aten::mm", "addmm",
                "bmm", "aten::linear")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("triton elementwise / reductions", ("triton_",)),
    ("softmax / reductions", ("softmax", "reduce", "argmax", "cumsum", "sort", "scan")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "index", "scatter", "gather", "cat", "copy", "fill")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profile_summary(prof, top: int = 12, device: bool = True) -> dict:
    """From a finished torch.profiler run: total self time (device kernels, or host ops when not
    `device`) in ms, the `top` entries by it, and the time per kind of kernel (KERNEL_KINDS)."""
    from torch.autograd import DeviceType

    def counted(e) -> bool:  # as torch's own table totals device time: device-side events only
        if not device:
            return True
        return e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)

    def self_ms(e) -> float:
        return (e.self_device_time_total if device else e.self_cpu_time_total) / 1e3

    events = [(e.key, self_ms(e), e.count) for e in prof.key_averages() if counted(e)]
    events = sorted((e for e in events if e[1] > 0), key=lambda e: -e[1])
    total = sum(ms for _, ms, _ in events)
    kinds: dict[str, float] = {}
    for name, ms, _ in events:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    return {"total_ms": total,
            "top": [{"name": name[:120], "ms": ms, "calls": n, "share_%": 100 * ms / total} for name, ms, n in events[:top]],
            "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}


def print_profile_summary(title: str, summary: dict) -> None:
    print(f"== {title}: {summary['total_ms']:.1f} ms of self time ==")
    print_table(summary["top"], ["name", "ms", "calls", "share_%"])
    print("by kind: " + ", ".join(f"{k} {v:.1f} ms ({100 * v / max(summary['total_ms'], 1e-9):.0f}%)"
                                  for k, v in summary["kinds_ms"].items()))


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
