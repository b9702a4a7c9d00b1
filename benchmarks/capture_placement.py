"""Capture through the `Target` against the runner before it, and with half the layers offloaded.

    python -m benchmarks.capture_placement [--seq 4096] [--batches 12] [--offload 0.5] [--tiny]

An 8B-shaped Llama (random bf16 weights, saved once to a local folder so that transformers can
place it) at T=4096, in one process:

1. **One device.** The capture runner as it was before the `Target` (commit 8dd38ca: the base
   model called directly, the tap's layers concatenated where they are; `BeforeRunner` below is
   that code) against today's (`HFCaptureRunner` over `Target.prefill`), the same batches,
   alternating rounds so that clock drift falls on both. Bar: today's >= 97% of before.
2. **Device map with offload.** `--device-map auto` with a `--max-memory` for GPU 0 that holds
   about (1 - --offload) of the decoder layers; the rest stay in CPU memory and accelerate copies
   each to the GPU as it runs. Tokens/s at the largest batch (of 64k, 32k, 16k, 8k tokens) that
   runs, against the same batch all on the GPU. Goal: at least 50%.

Nothing is written to disk in the timed spans (the runner's features are dropped as they come,
as benchmarks/capture.py's "runner only" row). `--tiny` checks the script on a CPU with a tiny
Llama (no figures are kept from it).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import print_table, write_result
from specfoundry.capture.runner import HFCaptureRunner, PendingCapture, pack
from specfoundry.common.placement import Placement
from specfoundry.common.taps import AuxLayerTap, decoder_layers
from specfoundry.common.target import Target
from specfoundry.families.eagle3.options import default_aux_layers


class BeforeRunner(HFCaptureRunner):
    """The capture runner's prefill as of commit 8dd38ca: the base model called directly with the
    model's own tap, outputs used where the model left them."""

    def __init__(self, model, aux_layers: list[int]):
        self.model = model
        self.base, _ = decoder_layers(model)
        self.tap = AuxLayerTap(model, aux_layers)
        self.aux_layers = self.tap.aux_layers
        self.storage, self.keep = None, True
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None

    @torch.inference_mode()
    def submit(self, batch: list[list[int]], index: int = 0) -> PendingCapture:
        lengths = [len(x) for x in batch]
        ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        for r, x in enumerate(batch):
            ids[r, : len(x)] = torch.tensor(x)
        self.tap.clear()
        out = self.base(input_ids=ids.to(self.device, non_blocking=True), use_cache=False)
        arrays = self.encode(self.tap.take(), out.last_hidden_state)
        pieces = {name: [a[r, :n] for r, n in enumerate(lengths)] for name, a in arrays.items()}
        layers = [f"layer {i}" for i in self.aux_layers]
        if not self.cuda:
            return PendingCapture(lengths, {name: torch.cat(p) for name, p in pieces.items()}, None, index, layers)
        packed, views = pack(pieces)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        packed.record_stream(self.copy_stream)
        return PendingCapture(lengths, views(host), done, index, layers)


def write_model(root: Path, tiny: bool) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000) if tiny else
             dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256))
    config = LlamaConfig(max_position_embeddings=8192, rope_theta=500000.0, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root)
    word_level_tokenizer().save_pretrained(root)  # Target.load loads one; capture is handed token ids
    return root


def word_level_tokenizer():
    """A stand-in tokenizer of three words: the benchmark feeds token ids, never text."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2},
                                                                               unk_token="<unk>")),
                                   unk_token="<unk>", eos_token="<unk>")


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tokens_per_s(runner, batches) -> float:
    """One untimed batch, then the rest; every result dropped as it comes."""
    for _ in runner.capture_all(batches[:1]):
        pass
    sync()
    t = time.perf_counter()
    for _ in runner.capture_all(batches[1:]):
        pass
    sync()
    return sum(len(x) for b in batches[1:] for x in b) / (time.perf_counter() - t)


def batches_of(n: int, rows: int, seq: int, vocab: int, seed: int = 0) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (seq,), generator=g).tolist() for _ in range(rows)] for _ in range(n)]


def one_device(path: Path, device: str, args, vocab: int, layers: list[int]) -> list[dict]:
    target = Target.load(str(path), device=device)
    before, ours = BeforeRunner(target.model, layers), HFCaptureRunner(target, layers)
    batches = batches_of(args.batches + 1, args.rows, args.seq, vocab)
    rates = {"before (8dd38ca)": [], "Target": []}
    for _ in range(args.rounds):  # alternating rounds: drift falls on both
        rates["before (8dd38ca)"].append(tokens_per_s(before, batches))
        rates["Target"].append(tokens_per_s(ours, batches))
    before.tap.remove()
    ours.close()
    del target
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    best = {name: max(r) for name, r in rates.items()}
    return [{"part": "one device", "variant": name, "batch_tokens": args.rows * args.seq, "tokens_per_s": best[name],
             "rounds": rates[name], "vs_before_%": 100 * best[name] / best["before (8dd38ca)"]} for name in rates]


def offloaded(path: Path, device: str, args, vocab: int, layers: list[int]) -> list[dict]:
    """All on the GPU against --offload of the decoder layers in CPU memory, at the largest batch
    that runs."""
    rows = []
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    gpu = device if device == "cpu" else 0
    budget = int(weights * (1 - args.offload))
    for name, placement in (("all on the GPU", Placement(device_map="auto", max_memory={gpu: "1000GiB"})),
                            (f"{args.offload:.0%} of the weights in CPU memory",
                             Placement(device_map="auto", max_memory={gpu: budget, "cpu": "1000GiB"}))):
        target = Target.load(str(path), device=device, placement=placement)
        on_cpu = layers_off_gpu(target)
        runner = HFCaptureRunner(target, layers)
        for batch_tokens in args.batch_tokens:
            n = max(1, batch_tokens // args.seq)
            try:
                rate = tokens_per_s(runner, batches_of(args.offload_batches + 1, n, args.seq, vocab, seed=1))
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                continue
            rows.append({"part": "device map", "variant": name, "batch_tokens": n * args.seq, "tokens_per_s": rate,
                         "layers_in_cpu_memory": on_cpu,
                         "gpu_peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available()
                         else None})
            break
        runner.close()
        del target, runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    if len(rows) == 2:
        rows[1]["vs_all_on_gpu_%"] = 100 * rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def layers_off_gpu(target: Target) -> int:
    """Decoder layers whose weights accelerate keeps in CPU memory (or on disk): the device map
    names a layer, or a module holding it."""
    placed = getattr(target.model, "hf_device_map", {})

    def where(name: str):
        while name and name not in placed:
            name = name.rpartition(".")[0]
        return placed.get(name, placed.get(""))

    return sum(where(f"model.layers.{i}") in ("cpu", "disk") for i in range(len(target.layers)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=2, help="Sequences per batch (part 1).")
    ap.add_argument("--batches", type=int, default=12, help="Timed batches per round (part 1).")
    ap.add_argument("--rounds", type=int, default=3, help="Alternating rounds (part 1); the best of each counts.")
    ap.add_argument("--offload", type=float, default=0.5, help="Share of the weights kept in CPU memory (part 2).")
    ap.add_argument("--batch-tokens", default="65536,32768,16384,8192",
                    help="Batch sizes to try in part 2, largest first.")
    ap.add_argument("--offload-batches", type=int, default=3, help="Timed batches in part 2.")
    ap.add_argument("--tiny", action="store_true", help="A tiny Llama on the CPU: checks the script only.")
    ap.add_argument("--dir", default=None, help="Where to save the model (a local disk).")
    args = ap.parse_args()
    args.batch_tokens = [int(x) for x in args.batch_tokens.split(",")]
    if args.tiny:
        args.seq, args.batches, args.rounds, args.batch_tokens = 64, 2, 1, [256]
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    root = Path(tempfile.mkdtemp(prefix="capture-placement-", dir=args.dir))
    try:
        t = time.perf_counter()
        path = write_model(root, args.tiny)
        print(f"model written in {time.perf_counter() - t:.0f} s")
        vocab = 1000 if args.tiny else 128256
        layers = default_aux_layers(8 if args.tiny else 32)
        rows = one_device(path, device, args, vocab, layers) + offloaded(path, device, args, vocab, layers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows, ["part", "variant", "batch_tokens", "tokens_per_s", "vs_before_%", "layers_in_cpu_memory",
                       "vs_all_on_gpu_%", "gpu_peak_GiB"])
    if device == "cuda":
        ours = next(r for r in rows if r["variant"] == "Target")
        summary = {"target_vs_before_pct": ours["vs_before_%"],
                   "offload_vs_all_on_gpu_pct": next((r.get("vs_all_on_gpu_%") for r in rows
                                                      if "vs_all_on_gpu_%" in r), None)}
        print(write_result("capture_placement", rows, {"summary": summary, "settings": vars(args)}))


if __name__ == "__main__":
    main()
