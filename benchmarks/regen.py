"""sf-regen throughput on one GPU: the hf backend (batched, length-sorted) against a plain
`model.generate` loop over the same prompts, in one process.

    python -m benchmarks.regen --tokenizer DIR [--prompts 128] [--batch-size 64]

Model: the SmolLM2-135M architecture with random weights (the device cannot take the real
weights in one call); a random model rarely ends a turn, so both sides generate max_new_tokens
for nearly every prompt: the work is the same, only the batching differs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import print_table, write_result
from specfoundry.generate.backend import SamplingConfig
from specfoundry.generate.hf_backend import HFBackend


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="Folder with SmolLM2's config.json and tokenizer files.")
    ap.add_argument("--prompts", type=int, default=128, help="Number of prompts.")
    ap.add_argument("--batch-size", type=int, default=64, help="hf backend batch size.")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="Tokens per answer.")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in json.loads((Path(args.tokenizer) / "config.json").read_text()).items()
                         if k not in ("architectures", "transformers_version")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    backend = HFBackend(None, batch_size=args.batch_size, model=model, tokenizer=tok)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 49000, (int(torch.randint(16, 256, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=args.max_new_tokens, seed=0)
    backend.generate_ids(prompts[:4], sampling, seed=0)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    gens = backend.generate_ids(prompts, sampling, seed=0)
    torch.cuda.synchronize()
    ours_s = time.perf_counter() - t
    ours_tokens = sum(x.num_tokens for x in gens)

    t = time.perf_counter()
    plain_tokens = 0
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8,
                                 max_new_tokens=args.max_new_tokens, eos_token_id=backend.stop_ids,
                                 pad_token_id=backend.pad_id)
            plain_tokens += out.shape[1] - ids.shape[1]
    torch.cuda.synchronize()
    plain_s = time.perf_counter() - t
    rows = [{"impl": f"ours: hf backend, batch {args.batch_size}, length-sorted", "output_tokens": ours_tokens,
             "seconds": ours_s, "tokens_per_s": ours_tokens / ours_s},
            {"impl": "plain model.generate loop", "output_tokens": plain_tokens, "seconds": plain_s,
             "tokens_per_s": plain_tokens / plain_s}]
    rows[0]["speedup"] = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    print_table(rows, ["impl", "output_tokens", "seconds", "tokens_per_s", "speedup"])
    print(write_result("regen", rows, {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens}))


if __name__ == "__main__":
    main()
