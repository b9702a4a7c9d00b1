"""Bytes per token on disk of a feature set for each container and storage dtype, and the lossy
dtypes' error on real features (float8, and the packed 6- and 4-bit codes of featureset/blockfp.py).

    python -m benchmarks.featureset_codecs runs/smollm2/regen [--tokens 4096]
    python -m benchmarks.featureset_codecs --acceptance RUN [--commit C]

Variants (container, aux states' dtype, final state's dtype):
    bf16_safetensors                 safetensors, bfloat16, bfloat16 (the raw baseline)
    bf16_zarr                        Zarr v3 + Blosc zstd, bfloat16, bfloat16 (lossless)
    fp8_safetensors                  safetensors, float8_e4m3fn, float8_e4m3fn (scales float32)
    fp8_aux_bf16_final_safetensors   safetensors, float8_e4m3fn, bfloat16
    fp8_zarr, fp8_aux_bf16_final_zarr    the same inside Zarr (zstd over the float8 bytes)
    fp6_safetensors, fp6_zarr        fp6_e2m3 for every state (codes, an e4m3 scale a block of 16, a
                                     float32 scale a row)
    fp4_safetensors, fp4_zarr        fp4_e2m1 likewise
    fp4_aux_fp8_final_safetensors    fp4_e2m1 layers, the final state (the teacher's input) in float8
    fp4_aux_topk32_safetensors       fp4_e2m1 layers and a top-32 teacher in the final state's place
                                     (--teacher-storage topk:32; at H 4096 random ids and probabilities
                                     of the stored dtypes: the bytes are the same for any)
Each lossy dtype's error is measured per row (token x layer) against the float32 capture; the
packed ones' beside their derived bound (max_err_over_bound at most 1), and, on the same rows, the
int4 and int6 grids that blockfp.py also holds (the float grids are the ones offered for storage:
`int_grids_error` says why), and an uncentred low-rank basis per layer at the same bytes
(`lowrank_error`: fitted on half the tokens, measured on the other half).

Two feature sets:
    smollm2  SmolLM2-135M's real features (H 576, layers [1, 14, 26] + final) of SOURCE, captured
             by sf-capture on this machine's CPU once per variant, plus once in float32: the
             reference float8's error is measured against (per row: token x layer).
    h4096    an 8B-shaped capture, H 4096, 3 aux layers + final, --tokens tokens of random
             Gaussian bf16 features written by the same shard writer. Random data compresses
             differently from real features (no shared prompt prefixes, no outlier channels,
             no massive activations): its safetensors sizes hold for any data, its Zarr ones
             only roughly.
Bytes per token count the shards (values, scales, token ids, loss mask, offsets, headers); the
SmolLM2 rows also give the whole set's (its manifest and vocabulary-sized token counts weigh on
a small set).

--acceptance RUN adds the encodings' acceptance to the existing results file, leaving its byte rows
as they are: RUN holds sf-eval outputs eval_<encoding>_seed<k> of EAGLE-3 drafts trained with one
recipe from captures feat_<encoding> of one regenerated set, bf16 among them (`scripts/measure_gpu.sh
codecs` makes them). It writes summary.acceptance_k7 ({run: {prompt set: accept length}}) and an
`acceptance` block: the runs' details and provenance, the means per encoding and set, bf16's seed
spread and the bar's verdict per encoding (on every set at most max(1% of bf16's mean, bf16's seed
spread) below bf16's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, print_table, write_result
from specfoundry.capture.stage import CaptureConfig, run_capture
from specfoundry.featureset import blockfp, fp8
from specfoundry.featureset.manifest import read_manifest
from specfoundry.featureset.store import PACKED, FeatureSet, decode_state, encode_state, write_shard

FP8 = "float8_e4m3fn"
TOPK = "topk:32"
VARIANTS = {  # name: (codec, storage dtype, final storage dtype[, teacher storage])
    "bf16_safetensors": ("safetensors", "bfloat16", "bfloat16"),
    "bf16_zarr": ("zarr", "bfloat16", "bfloat16"),
    "fp8_safetensors": ("safetensors", FP8, FP8),
    "fp8_aux_bf16_final_safetensors": ("safetensors", FP8, "bfloat16"),
    "fp8_zarr": ("zarr", FP8, FP8),
    "fp8_aux_bf16_final_zarr": ("zarr", FP8, "bfloat16"),
    "fp6_safetensors": ("safetensors", "fp6_e2m3", "fp6_e2m3"),
    "fp6_zarr": ("zarr", "fp6_e2m3", "fp6_e2m3"),
    "fp4_safetensors": ("safetensors", "fp4_e2m1", "fp4_e2m1"),
    "fp4_zarr": ("zarr", "fp4_e2m1", "fp4_e2m1"),
    "fp4_aux_fp8_final_safetensors": ("safetensors", "fp4_e2m1", FP8),
    "fp4_aux_topk32_safetensors": ("safetensors", "fp4_e2m1", "fp4_e2m1", TOPK),
}
BAR_H4096 = 16500  # float8 for every state: at most this many bytes per token at H 4096


def size_on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def relative_row_error(rows: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    """|back - rows| / |rows| per row (the last dimension's L2 norms), a zero row's error against 1e-30."""
    return (back - rows).norm(dim=-1) / rows.norm(dim=-1).clamp(min=1e-30)


def row_errors(x: torch.Tensor, decoded: torch.Tensor, layers: int) -> dict:
    """float8's error over rows of x [N, L*H] (float32) against their decoded values."""
    rows, back = x.unflatten(-1, (layers, -1)), decoded.unflatten(-1, (layers, -1))  # [N, L, H]
    absmax = rows.abs().amax(-1)  # [N, L]
    scale = absmax / fp8.E4M3_MAX
    err = (back - rows).abs()
    rel = relative_row_error(rows, back)  # [N, L]
    normal = rows.abs() >= 2**-6 * scale.unsqueeze(-1)  # e4m3 normals: the rest are subnormal or zero
    massive = absmax > 100 * absmax.median(dim=0).values  # rows far above their layer's typical absmax
    bound = fp8.RELATIVE_ERROR * rows.abs() + fp8.SUBNORMAL_ERROR * scale.unsqueeze(-1)
    out = {"rows": rel.numel(), "row_rel_l2_median": rel.median().item(),
           "row_rel_l2_p99": rel.flatten().quantile(0.99).item(), "row_rel_l2_max": rel.max().item(),
           "elem_rel_err_mean_normal": (err[normal] / rows.abs()[normal]).mean().item(),
           "subnormal_share": 1 - normal.float().mean().item(),
           "max_err_over_bound": (err / bound.clamp(min=1e-38)).max().item(),
           "massive_rows": int(massive.sum())}
    if massive.any():
        out["massive_absmax_median"] = absmax[massive].median().item()
        out["massive_row_rel_l2_median"] = rel[massive].median().item()
        out["massive_subnormal_share"] = 1 - normal[massive].float().mean().item()
    return out


def packed_row_errors(x: torch.Tensor, decoded: torch.Tensor, layers: int, fmt: blockfp.Format) -> dict:
    """A packed dtype's error over rows of x [N, L*H] (float32) against their decoded values, and the
    largest ratio of an element's error to blockfp's bound before the scales."""
    rows, back = x.unflatten(-1, (layers, -1)), decoded.unflatten(-1, (layers, -1))  # [N, L, H]
    h = rows.shape[-1]
    err = (back - rows).abs()
    rel = relative_row_error(rows, back)  # [N, L]
    block = rows.abs().unflatten(-1, (h // blockfp.BLOCK, blockfp.BLOCK)).amax(-1)
    scale = rows.abs().amax(-1, keepdim=True) / (fmt.largest * fp8.E4M3_MAX)
    d, g = fmt.largest_gap, fmt.largest
    bound = (block * d / (2 * g) * (1 + 2.0**-3) + scale * d / 2 * 2.0**-9).repeat_interleave(blockfp.BLOCK, -1)
    bound = bound + 2.0**-22 * rows.abs()
    return {"rows": rel.numel(), "row_rel_l2_median": rel.median().item(),
            "row_rel_l2_p99": rel.flatten().quantile(0.99).item(), "row_rel_l2_max": rel.max().item(),
            "max_err_over_bound": (err / bound.clamp(min=1e-38)).max().item()}


def grid_errors(x: torch.Tensor, layers: int) -> dict:
    """Every grid of blockfp.FORMATS on rows of x [N, L*H] (float32), quantised here: its row errors."""
    rows = x.unflatten(-1, (layers, -1))
    out = {}
    for name, fmt in blockfp.FORMATS.items():
        back = blockfp.dequantize(*blockfp.quantize(rows, fmt), fmt, torch.float32)
        out[name] = packed_row_errors(x, back.flatten(-2), layers, fmt)
    return out


# bytes a value each lossy dtype stores (float8's 1; the packed rows' R/H, block scales included): what
# the basis' bf16 coefficients may take at the same size
LOWRANK_BYTES = {"fp8": 1.0, "fp6": 13 / 16, "fp4": 9 / 16}


def lowrank_errors(x: torch.Tensor, layers: int) -> dict:
    """The uncentred low-rank basis per layer (the one an export could fold into the draft's first
    linear layer) on rows of x [N, L*H] (float32): fitted on the first half of the tokens (the top
    right singular vectors of that half), its row error on the second half, at the ranks whose bf16
    coefficients take as many bytes a row as fp8, fp6 and fp4 values would (r = bytes * H / 2).
    Projecting onto an orthonormal basis V [H, r] is the least-squares fit in it: x V V^T."""
    rows = x.unflatten(-1, (layers, -1))  # [N, L, H]
    n, h = rows.shape[0] // 2, rows.shape[-1]
    out = {}
    for name, per_value in LOWRANK_BYTES.items():
        r = int(per_value * h / 2)
        rel = []
        for layer in range(layers):
            fit, held = rows[:n, layer].double(), rows[n:, layer].double()  # [n, H], [N - n, H]
            basis = torch.linalg.svd(fit, full_matrices=False).Vh[:r].T  # [H, r]
            back = held @ basis @ basis.T
            rel.append(relative_row_error(held, back))
        rel = torch.cat(rel)
        out[f"like_{name}"] = {"rank": r, "bytes_per_value": per_value, "rows": rel.numel(),
                               "row_rel_l2_median": rel.median().item(), "row_rel_l2_p99": rel.quantile(0.99).item()}
    return out


def states(fs: FeatureSet, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Every token's aux [N, K*H] and final [N, H] states of a set, decoded to dtype."""
    out = {"aux": [], "final": []}
    for shard in range(len(fs.shards)):
        r = fs.reader(shard)
        n = int(r.offsets[-1])
        for state in out:
            out[state].append(decode_state(*r.state(state, 0, n), dtype, r.dtypes[state]))
    return {state: torch.cat(parts) for state, parts in out.items()}


def smollm2_rows(source: str, target: str, tmp: Path) -> tuple[list[dict], dict]:
    rows, sets = [], {}
    for name, (codec, dtype, final_dtype, *teacher) in {"fp32_safetensors": ("safetensors", "float32", "float32"),
                                                        **VARIANTS}.items():
        out = tmp / name
        start = time.perf_counter()
        run_capture(CaptureConfig(source=source, output=str(out), target=target, codec=codec, storage_dtype=dtype,
                                  final_storage_dtype=final_dtype, shard_size=64,
                                  teacher_storage=teacher[0] if teacher else "final"), silent=True)
        seconds = time.perf_counter() - start
        m = read_manifest(out)
        tokens = m["counts"]["tokens"]
        sets[name] = FeatureSet(out)
        rows.append({"set": "smollm2", "variant": name, "codec": codec, "storage_dtype": dtype,
                     "final_storage_dtype": final_dtype, "hidden": m["hidden_size"], "samples": m["counts"]["samples"],
                     "tokens": tokens, "shard_bytes_per_token": round(size_on_disk(out / "shards") / tokens, 1),
                     "set_bytes_per_token": round(size_on_disk(out) / tokens, 1), "capture_s": round(seconds, 1)})
    reference = states(sets["fp32_safetensors"])
    got = states(sets["fp8_safetensors"])
    layers = len(sets["fp8_safetensors"].manifest["aux_layer_ids"])
    errors = {"aux": row_errors(reference["aux"], got["aux"], layers),
              "final": row_errors(reference["final"], got["final"], 1)}
    for name, dtype in (("fp6", "fp6_e2m3"), ("fp4", "fp4_e2m1")):
        packed = states(sets[f"{name}_safetensors"])
        errors[name] = {"aux": packed_row_errors(reference["aux"], packed["aux"], layers, PACKED[dtype]),
                        "final": packed_row_errors(reference["final"], packed["final"], 1, PACKED[dtype])}
    errors["grids_aux"] = grid_errors(reference["aux"], layers)
    errors["lowrank_aux"] = lowrank_errors(reference["aux"], layers)
    return rows, errors


def h4096_rows(tokens: int, tmp: Path, seq: int = 1024) -> tuple[list[dict], dict]:
    h, k = 4096, 3
    g = torch.Generator().manual_seed(0)
    n = max(1, tokens // seq)
    samples = [{"input_ids": torch.randint(0, 128256, (seq,), generator=g), "loss_mask": torch.ones(seq, dtype=torch.bool),
                "aux_hidden": torch.randn(seq, k * h, generator=g).bfloat16(),
                "final_hidden": torch.randn(seq, h, generator=g).bfloat16()} for _ in range(n)]
    rows = []
    for name, (codec, dtype, final_dtype, *teacher) in VARIANTS.items():
        start = time.perf_counter()
        written = samples
        if teacher:  # the stored dtypes' bytes, whatever the ids and probabilities: random ones
            topk = int(teacher[0].split(":")[1])
            written = [{**{key: v for key, v in s.items() if key != "final_hidden"},
                        "teacher_ids": torch.randint(0, 128256, (seq, topk), generator=g, dtype=torch.int32),
                        "teacher_probs": torch.rand(seq, topk, generator=g).sort(-1, descending=True).values.half()}
                       for s in samples]
        write_shard(tmp / name, "shards/shard", written, codec, dtype, final_dtype, layers=k)
        seconds = time.perf_counter() - start
        rows.append({"set": "h4096", "variant": name, "codec": codec, "storage_dtype": dtype,
                     "final_storage_dtype": final_dtype, "hidden": h, "samples": n, "tokens": n * seq,
                     "shard_bytes_per_token": round(size_on_disk(tmp / name / "shards") / (n * seq), 1),
                     "write_s": round(seconds, 2)})
    aux = torch.cat([s["aux_hidden"] for s in samples]).float()  # [N, 3H]
    errors = {"aux": row_errors(aux, decode_state(*encode_state(aux, FP8, k), torch.float32), k)}
    return rows, errors


RELATIVE_BAR = 0.01  # an encoding's acceptance within 1% of bf16's on a set (or bf16's seed spread there)


def acceptance_verdict(acceptance: dict[str, dict[str, float]]) -> dict:
    """acceptance: {"<encoding>_seed<k>": {prompt set: accept length}}, bf16 among the encodings. Per
    encoding and set the mean over its seeds; bf16's seed spread per set (|seed0 - seed1|, 0 with one
    seed); the bar per encoding: on every set its mean at most max(1% of bf16's, bf16's spread
    there) below bf16's mean."""
    seeds: dict[str, list[str]] = {}
    for name in sorted(acceptance):
        encoding, _, seed = name.rpartition("_seed")
        if not encoding or not seed.isdigit():
            raise SystemExit(f"eval_{name}: not eval_<encoding>_seed<k>")
        seeds.setdefault(encoding, []).append(name)
    if "bf16" not in seeds:
        raise SystemExit("no eval_bf16_seed<k> run: the encodings are measured against bf16")
    sets = sorted(next(iter(acceptance.values())))
    mean = {enc: {s: statistics.fmean(acceptance[n][s] for n in names) for s in sets} for enc, names in seeds.items()}
    bf16 = [acceptance[n] for n in seeds["bf16"]]
    spread = {s: max(r[s] for r in bf16) - min(r[s] for r in bf16) for s in sets}
    tolerance = {s: max(RELATIVE_BAR * mean["bf16"][s], spread[s]) for s in sets}
    return {"per_set_mean": mean, "seeds": {enc: len(names) for enc, names in seeds.items()},
            "bf16_seed_spread": spread, "tolerance": tolerance,
            "vs_bf16_%": {enc: {s: 100 * (m[s] / mean["bf16"][s] - 1) for s in sets} for enc, m in mean.items()},
            "holds_on_every_set": {enc: all(m[s] >= mean["bf16"][s] - tolerance[s] for s in sets)
                                   for enc, m in mean.items()}}


def record_acceptance(run: Path, commit: str | None) -> Path:
    """Adds summary.acceptance_k7 and the `acceptance` block to results/featureset_codecs.json, from
    RUN's eval_<encoding>_seed<k> folders (bf16 among them) and their feat_<encoding> captures."""
    runs, acceptance = {}, {}
    names = sorted(p.name.removeprefix("eval_") for p in run.glob("eval_*_seed*") if (p / "eval.json").is_file())
    if not names:
        raise SystemExit(f"{run}: no eval_<encoding>_seed<k>/eval.json")
    for name in names:
        report = json.loads((run / f"eval_{name}" / "eval.json").read_text())
        acceptance[name] = {s: v["trained"]["accept_length"] for s, v in report["sets"].items()}
        runs[name] = {"config": report["config"], "environment": report.get("environment"),
                      "sets": {s: {k: v["trained"].get(k) for k in ("prompts", "rounds", "tokens", "accept_length",
                                                                     "accept_rate_by_position")}
                               for s, v in report["sets"].items()}}
        train_config = run / f"train_{name}" / "train_config.json"
        if train_config.exists():
            runs[name]["train_config"] = json.loads(train_config.read_text())
    verdict = acceptance_verdict(acceptance)
    regen = json.loads((run / "regen" / "manifest.json").read_text())
    captures = {}
    for st in sorted({name.rpartition("_seed")[0] for name in names}):
        m = json.loads((run / f"feat_{st}" / "manifest.json").read_text())
        captures[st] = {k: m.get(k) for k in ("codec", "storage_dtype", "final_storage_dtype", "teacher",
                                              "aux_layer_ids", "counts")}
    # DFlash drafts (block 16) from two of the captures: dflash_eval_<encoding>
    dflash = {p.name.removeprefix("dflash_eval_"): {s: v["trained"]["accept_length"] for s, v in
                                                     json.loads((p / "eval.json").read_text())["sets"].items()}
              for p in sorted(run.glob("dflash_eval_*")) if (p / "eval.json").is_file()}
    path = RESULTS / "featureset_codecs.json"
    data = json.loads(path.read_text())
    data["summary"]["acceptance_k7"] = acceptance
    if dflash:
        data["summary"]["acceptance_dflash_b16"] = dflash
    data["acceptance"] = {
        "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "how": "scripts/measure_gpu.sh codecs: sf-regen --recipe recipes/smollm2-h200.yaml --synthesize N; sf-capture "
               "--recipe ... --storage-dtype D [--teacher-storage topk:K] per encoding; sf-train --recipe ... --epochs "
               "E --warmup-steps 30 --seed k (side by side); sf-eval --recipe ... --no-baseline (k=7 chain, greedy, "
               "every built-in prompt)",
        "regen_totals": regen.get("totals"), "regen_config": regen.get("config"), "captures": captures,
        "runs": runs, "verdict": verdict}
    data["not_measured"] = ("capture and train-step speed of each encoding against bf16 are in "
                            "results/capture.json and results/train_step.json where measured")
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", help="Conversations or an sf-regen folder to capture with SmolLM2.")
    ap.add_argument("--target", default="smollm2", help="The target of the real capture.")
    ap.add_argument("--tokens", type=int, default=4096, help="Tokens of the random H=4096 capture.")
    ap.add_argument("--acceptance", default=None, help="A run folder of `scripts/measure_gpu.sh codecs`: add its "
                    "acceptance runs to the existing results file instead of measuring bytes.")
    ap.add_argument("--commit", default=None, help="--acceptance: the commit the runs were made at.")
    args = ap.parse_args()
    if args.acceptance:
        path = record_acceptance(Path(args.acceptance), args.commit)
        verdict = json.loads(path.read_text())["acceptance"]["verdict"]
        print(json.dumps(verdict, indent=2))
        print(f"wrote {path}")
        return
    if not args.source:
        ap.error("give SOURCE (bytes per token) or --acceptance RUN")
    with tempfile.TemporaryDirectory() as tmp:
        smol, smol_errors = smollm2_rows(args.source, args.target, Path(tmp) / "smollm2")
        big, big_errors = h4096_rows(args.tokens, Path(tmp) / "h4096")
    rows = smol + big
    print_table(rows, ["set", "variant", "tokens", "shard_bytes_per_token", "set_bytes_per_token", "capture_s",
                       "write_s"])
    for where, errors in (("smollm2", smol_errors), ("h4096 random", big_errors)):
        for state in ("aux", "final"):
            if state in errors:
                print(f"float8 error, {where} {state}: " + ", ".join(f"{k} {v:.4g}" for k, v in errors[state].items()))
    for name, e in {**{n: smol_errors[n]["aux"] for n in ("fp6", "fp4")}, **smol_errors["grids_aux"],
                    **smol_errors["lowrank_aux"]}.items():
        print(f"{name} error, smollm2 aux: " + ", ".join(f"{k} {v:.4g}" for k, v in e.items()))
    per_token = {r["variant"]: r["shard_bytes_per_token"] for r in big}
    summary = {"bytes_per_token_h4096": per_token,
               "bytes_per_token_smollm2": {r["variant"]: r["shard_bytes_per_token"] for r in smol
                                           if r["variant"] in VARIANTS},
               "bf16_bytes_per_token_h4096_raw": 4 * 4096 * 2,
               "bar_fp8_all_states_h4096": BAR_H4096,
               "fp8_all_states_meets_bar": per_token["fp8_safetensors"] <= BAR_H4096,
               "at_most_8KiB_h4096": sorted(v for v, b in per_token.items() if b <= 8192),
               "row_rel_l2_median_smollm2_aux": {
                   "fp8": smol_errors["aux"]["row_rel_l2_median"],
                   **{n: e["row_rel_l2_median"] for n, e in smol_errors["grids_aux"].items()},
                   **{f"lowrank_{n}": e["row_rel_l2_median"] for n, e in smol_errors["lowrank_aux"].items()}}}
    extra = {"summary": summary,
             "fp8_error": {"smollm2": {k: smol_errors[k] for k in ("aux", "final")}, "h4096_random": big_errors},
             "packed_error": {"smollm2": {k: smol_errors[k] for k in ("fp6", "fp4")}},
             "int_grids_error": {"smollm2_aux": smol_errors["grids_aux"],
                                 "why": "at equal bits the int grids' row error on real features is above the float "
                                        "grids' (heavy-tailed rows: most values far below the block's absmax), so "
                                        "fp6_e2m3 and fp4_e2m1 are the storage dtypes"},
             "lowrank_error": {"smollm2_aux": smol_errors["lowrank_aux"],
                               "why": "an uncentred basis per layer fitted on half the tokens, at the rank whose "
                                      "bf16 coefficients cost what fp8, fp6 or fp4 values would: its row error on "
                                      "the other half against the packed grids' at the same bytes decides whether "
                                      "the basis (and its fold into the draft at export) is offered"},
             "not_measured": NOT_MEASURED}
    earlier = RESULTS / "featureset_codecs.json"
    if earlier.is_file() and "acceptance" in (kept := json.loads(earlier.read_text())):
        # the GPU's acceptance runs are another measurement, with their own commit and date: kept
        summary["acceptance_k7"] = kept["summary"]["acceptance_k7"]
        extra["acceptance"] = kept["acceptance"]
    print(f"wrote {write_result('featureset_codecs', rows, extra)}")


NOT_MEASURED = ("acceptance_k7 (drafts trained from a bf16 and a float8 capture of the same regenerated set, "
                "two seeds each: --acceptance RUN) and the capture and train-step speeds ("
                "python -m benchmarks.capture and python -m benchmarks.train_step, which compare bf16 and float8 "
                "side by side) need a GPU; they are not in this file.")


if __name__ == "__main__":
    main()
