"""MoE targets against dense on one GPU: bare prefill and capture tokens/s and MFU for each
experts implementation, side by side in one process (random bf16 weights: speed does not depend
on them).

Shapes (reduced layer counts, so that one GPU holds them; per-layer speed is what is compared):
    dense_8b        Llama-3.1-8B, 12 of its 32 layers
    qwen3_30b_a3b   Qwen3-30B-A3B: 128 experts of width 768, top 8; 12 of its 48 layers
    deepseek_v3     DeepSeek-V3: MLA, 256 routed experts of width 2048 (top 8 within the best 4 of 8
                    groups) and a shared one; 3 layers, the first dense as in the model (61 layers,
                    the first 3 dense)
Experts implementations (common/experts.py): eager (transformers' loop), grouped_mm (torch's
grouped GEMM, transformers' default) and sf_fused (kernels/fused_moe.py). Tokens a batch: 8k, 32k
and 64k (2, 8 and 16 sequences of 4096).

    bare      model.model(input_ids), no cache, nothing kept
    capture   sf-capture's runner (hooks on 3 layers + the final state, copied to host on a side
              stream); nothing written (benchmarks/capture.py measures the writer)

MFU = 2 x active parameters (without embeddings; a routed expert counts top_k / experts of its
weights) x tokens/s over 790 TFLOP/s. Attention FLOPs are not counted.

    python -m benchmarks.capture_moe [--tokens 8192,32768,65536] [--impls eager,grouped_mm,sf_fused]
                                     [--profile] [--compile-layers attention,layer]
                                     [--launch BM,BN,BK,WARPS,STAGES]
    python -m benchmarks.capture_moe --device cpu --shapes tiny      # checks the script on a CPU

--compile-layers adds, for every implementation but eager and each choice of sf-capture's
--compile-layers given (common/compiled_layers.py), a row `IMPL+compiled_CHOICE`: `attention`, each
decoder layer's attention block (projections, q/k norms, rotary, attention) and its two RMSNorms
through torch.compile (dynamic shapes), the experts as IMPL runs them; `layer`, each whole decoder
layer's forward. The profile of the whole forward put 43% of the Qwen3-30B-A3B forward's kernel
time in unfused elementwise work. PYTORCH_CUDA_ALLOC_CONF defaults to expandable_segments:True
here: with the compiled rows beside the others, DeepSeek-V3's grouped_mm ran out of memory at 32k
tokens with 10.8 GiB reserved but free.

--profile: PyTorch profiler breakdowns (kernels grouped by kind) per implementation at each token
count, into the JSON's "profile": the whole bare forward (`SHAPE/IMPL/TOKENS/model`, dense too) and
one MoE layer's block (`SHAPE/IMPL/TOKENS`).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # (the docstring; before torch)

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    MATMUL_TFLOPS,
    cuda_time_ms_interleaved,
    print_profile_summary,
    print_table,
    profile_summary,
    write_result,
)
from specfoundry.capture.runner import HFCaptureRunner  # noqa: E402
from specfoundry.common.compiled_layers import COMPILE_LAYERS, compile_layers  # noqa: E402
from specfoundry.common.experts import FUSED_EXPERTS, experts_modules, set_experts  # noqa: E402
from specfoundry.common.target import Target  # noqa: E402
from specfoundry.kernels import fused_moe  # noqa: E402
from specfoundry.kernels.fused_moe import MoeLaunch, Tiles, register_fused_experts  # noqa: E402

SEQ = 4096
SHAPES = {
    "dense_8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=12, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                               rope_theta=500000.0)),
    "qwen3_30b_a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                        vocab_size=151936, max_position_embeddings=40960, decoder_sparse_step=1,
                                        mlp_only_layers=[])),
    "deepseek_v3": ("deepseek_v3", dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                                        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=128,
                                        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
                                        topk_group=4, routed_scaling_factor=2.5, vocab_size=129280,
                                        max_position_embeddings=8192)),
}
TINY = {  # --shapes tiny: the same three kinds, small enough for a CPU
    "dense_8b": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=1000)),
    "qwen3_30b_a3b": ("qwen3_moe", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=1000)),
    "deepseek_v3": ("deepseek_v3", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                                        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                                        num_experts_per_tok=2, n_group=2, topk_group=1, vocab_size=1000)),
}


def build(model_type: str, fields: dict, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **fields)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):  # built where it runs: its buffers (rotary tables) initialised there
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def active_params(model) -> float:
    """Parameters a token runs through, embeddings and lm_head left out: a routed expert's weights
    count top_k / experts of theirs."""
    cfg = model.config
    top_k = getattr(cfg, "num_experts_per_tok", 1)
    experts = {id(p) for m in experts_modules(model) for p in m.parameters()}
    total = 0.0
    for name, p in model.model.named_parameters():
        if "embed_tokens" in name:
            continue
        share = top_k / next(m.num_experts for m in experts_modules(model)) if id(p) in experts else 1.0
        total += p.numel() * share
    return total


COMPILED = "+compiled_"  # IMPL+compiled_CHOICE: a row with compile_layers(model, CHOICE)


def split_row(impl: str) -> tuple[str, str]:
    """A row's experts implementation and its compile_layers choice ("off" without the suffix)."""
    experts, _, how = impl.partition(COMPILED)
    return experts, how or "off"


def moe_layer(model):
    """The first decoder layer that has routed experts (the profiled one), or None."""
    mods = experts_modules(model)
    return next((layer for layer in model.model.layers if any(m in mods for m in layer.modules())), None)


def time_fitting(fns: dict, iters: int) -> tuple[dict, set, bool]:
    """CUDA-event ms of each fn, interleaved; if that runs out of memory, each (implementation,
    path) timed alone (without the interleaving that evens out clock drift: the rows say `timed:
    alone`), and those that still do not fit are returned apart (their rows say so: grouped_mm at
    64k tokens on DeepSeek-V3 does not fit an 80 GB card) instead of ending the run. Returns (ms,
    what did not fit, whether timed alone)."""
    try:
        return cuda_time_ms_interleaved(fns, warmup=2, iters=iters), set(), False
    except torch.OutOfMemoryError:
        pass
    ms, failed = {}, set()
    for key, fn in fns.items():
        torch.cuda.empty_cache()
        try:
            ms.update(cuda_time_ms_interleaved({key: fn}, warmup=2, iters=iters))
        except torch.OutOfMemoryError:
            failed.add(key)
    torch.cuda.empty_cache()
    return ms, failed, True


def profiled(fn, calls: int = 1):
    """torch.profiler of `calls` calls of fn after one untimed call (CUDA activity), or None when
    that runs out of memory."""
    try:
        with torch.inference_mode():
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
        return prof
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def measure_shape(shape, model_type, fields, counts, seq, args, rows, summary_mfu, summary_capture, profile):
    """Every implementation's rows for one shape (its model freed on return)."""
    cuda = args.device == "cuda"
    model = build(model_type, fields, args.device)
    target = Target.wrap(model)
    params = active_params(model)
    moe = bool(experts_modules(model))
    impls = args.impls.split(",") if moe else ["dense"]
    choices = [c for c in args.compile_layers.split(",") if c] if args.compile_layers else []
    impls += [impl + COMPILED + how for how in choices for impl in impls if impl != "eager"]
    layers = model.config.num_hidden_layers
    runner = HFCaptureRunner(target, [1, layers // 2, layers - 1])

    def use(impl: str) -> None:  # the experts implementation, and the layers compiled or not
        experts, how = split_row(impl)
        if choices:
            compile_layers(model, how)
        if moe:
            set_experts(model, experts, args.device)
    for tokens in counts:
        ids = torch.randint(0, model.config.vocab_size, (tokens // seq, seq), device=args.device)
        fns = {}
        for impl in impls:
            if impl == "eager" and tokens > args.eager_up_to:
                continue
            if split_row(impl)[0] == FUSED_EXPERTS and not cuda and args.shapes == "real":
                continue

            def bare(impl=impl, ids=ids):
                use(impl)
                model.model(input_ids=ids, use_cache=False)

            def capture(impl=impl, ids=ids):
                use(impl)
                for _ in runner.capture_all([ids.tolist()]):
                    pass

            fns[(impl, "bare")] = bare
            fns[(impl, "capture")] = capture
        out_of_memory, alone = set(), False
        with torch.inference_mode():
            if cuda:
                ms, out_of_memory, alone = time_fitting(fns, args.iters)
            else:
                ms = {}
                for key, fn in fns.items():
                    t = time.perf_counter()
                    fn()
                    ms[key] = 1e3 * (time.perf_counter() - t)
        for impl, kind in sorted(out_of_memory):
            rows.append({"shape": shape, "experts": impl, "tokens": tokens, "path": kind, "error": "out of memory"})
        for (impl, kind), t in ms.items():
            peak = None
            if cuda and kind == "bare":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                try:
                    with torch.inference_mode():
                        fns[(impl, kind)]()
                    torch.cuda.synchronize()
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                except torch.OutOfMemoryError:  # (it fitted when timed; the row keeps its times)
                    torch.cuda.empty_cache()
            tps = tokens / (t / 1e3)
            mfu = 100 * 2 * params * tps / 1e12 / MATMUL_TFLOPS
            rows.append({"shape": shape, "experts": impl, "tokens": tokens, "path": kind, "ms": t,
                         "tokens_per_s": tps, "MFU_%": mfu, "peak_GiB_above_weights": peak,
                         **({"timed": "alone"} if alone else {})})
            if tokens == 32768 or args.shapes == "tiny":
                table = summary_mfu if kind == "bare" else summary_capture
                table.setdefault(shape, {})[impl] = mfu if kind == "bare" else tps
        if args.profile and cuda:  # the whole bare forward, by kind: where a layer's time goes besides its experts
            for impl in impls:
                if (impl, "bare") not in ms:
                    continue
                key = f"{shape}/{impl}/{tokens}/model"
                prof = profiled(fns[(impl, "bare")])
                if prof is None:
                    profile[key] = {"error": "out of memory under the profiler"}
                    print(f"== {key}: out of memory under the profiler ==")
                    continue
                profile[key] = profile_summary(prof)
                print_profile_summary(f"{key}: the bare forward, {layers} layers", profile[key])
        if args.profile and moe and cuda:
            layer = moe_layer(model)
            x = torch.randn(ids.shape[0], seq, model.config.hidden_size, device=args.device, dtype=model.dtype)
            for impl in impls:
                if (impl == "eager" and tokens > args.eager_up_to) or COMPILED in impl:
                    continue  # (the MoE block alone: no attention in it)
                set_experts(model, impl, args.device)
                key = f"{shape}/{impl}/{tokens}"
                prof = profiled(lambda mlp=layer.mlp, x=x: mlp(x), calls=3)
                if prof is None:
                    profile[key] = {"error": "out of memory under the profiler"}
                    print(f"== {key}: out of memory under the profiler ==")
                    continue
                profile[key] = profile_summary(prof)
                print_profile_summary(f"{key}: one MoE block, 3 calls", profile[key])
    runner.tap.remove()


def parse_launch(text: str) -> MoeLaunch:
    """--launch's 5 or 9 comma-separated numbers (its help)."""
    n = [int(v) for v in text.split(",")]
    if len(n) == 5:
        return MoeLaunch.uniform(*n)
    if len(n) == 9:
        return MoeLaunch(n[0], Tiles(*n[1:5]), Tiles(*n[5:9]))
    raise SystemExit(f"--launch {text!r}: give 5 or 9 comma-separated numbers")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,32768,65536", help="Tokens a batch (sequences of 4096), comma-separated.")
    ap.add_argument("--impls", default=f"eager,grouped_mm,{FUSED_EXPERTS}", help="Experts implementations.")
    ap.add_argument("--eager-up-to", type=int, default=32768,
                    help="Largest batch the (slow) eager loop is timed at.")
    ap.add_argument("--iters", type=int, default=5, help="Timed iterations (after 2 warm-ups).")
    ap.add_argument("--profile", action="store_true", help="Profile one MoE layer per implementation.")
    ap.add_argument("--compile-layers", default="", help=f"Comma-separated, of {', '.join(COMPILE_LAYERS[1:])}: "
                    "add IMPL+compiled_CHOICE rows (the module docstring).")
    ap.add_argument("--launch", default=None, help="The fused kernels' tiles: BM,BN,BK,WARPS,STAGES for both, or "
                    "BM then BN,BK,WARPS,STAGES of gate_up then of down (9 numbers); default: by shape.")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check the script (--shapes tiny).")
    ap.add_argument("--shapes", default="real", choices=["real", "tiny"])
    ap.add_argument("--out", default="capture_moe", help="The result's name under benchmarks/results/.")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if args.launch:
        launch = parse_launch(args.launch)
        fused_moe.default_launch = lambda *a, **k: launch  # noqa: E731  (a sweep's fixed tiles)
    register_fused_experts(FUSED_EXPERTS)
    counts = [int(t) for t in args.tokens.split(",")]
    seq = SEQ if args.shapes == "real" else 64
    if args.shapes == "tiny":
        counts = [seq * 2]
    rows, summary_mfu, summary_capture, profile = [], {}, {}, {}
    for shape, (model_type, fields) in (SHAPES if args.shapes == "real" else TINY).items():
        measure_shape(shape, model_type, fields, counts, seq, args, rows, summary_mfu, summary_capture, profile)
        if cuda:
            torch.cuda.empty_cache()
    for r in rows:  # against the dense shape at the same token count and path
        dense = next((d for d in rows if d["shape"] == "dense_8b" and d["tokens"] == r["tokens"]
                      and d["path"] == r["path"]), None)
        if dense and "MFU_%" in r and "MFU_%" in dense:
            r["MFU_vs_dense_%"] = 100 * r["MFU_%"] / dense["MFU_%"]
    print_table(rows, ["shape", "experts", "tokens", "path", "ms", "tokens_per_s", "MFU_%", "MFU_vs_dense_%",
                       "peak_GiB_above_weights", "timed", "error"])
    if not cuda:
        print("(CPU: a check of the script, no figures)")
        return
    print(write_result(args.out, rows, {"summary": {"mfu_pct_32k": summary_mfu,
                                                         "capture_tokens_per_s_32k": summary_capture},
                                             "seq": seq, "profile": profile, "launch": args.launch}))


if __name__ == "__main__":
    main()
