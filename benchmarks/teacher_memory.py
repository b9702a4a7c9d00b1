"""Peak host memory of the teacher (families/teacher.py) and the vocabulary map at a large vocabulary.

    python -m benchmarks.teacher_memory [--vocab 262144] [--hidden 640] [--rows 4096]

The teacher scores every row's final state with the target's lm_head [V, H] over the whole
vocabulary, chunk by chunk. Each measurement runs in a fresh process on the CPU: the inputs (the
final states [rows, H] and the head [V, H], fp32) are made first, then the process's peak resident
memory is read before and after the call; the difference is what the call itself needed at its
peak, its output included (the soft targets [rows, 32000], fp32 here: `output_mib`). Rows: the default chunk (teacher.logit_rows: 256 rows at Gemma-3's 262,144), the former fixed
1024 rows, and the vocabulary map (choose_draft_vocab + vocab_maps from [V] token counts, 32k draft
tokens).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

from benchmarks.common import print_table, write_result
from specfoundry.families.teacher import logit_rows, teacher_targets
from specfoundry.families.vocab import choose_draft_vocab, vocab_maps


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(what: str, vocab: int, hidden: int, rows: int, chunk: int | None) -> dict:
    """One measurement in this process (called in a fresh one by main)."""
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 1000, (vocab,), generator=g)
    draft_ids = choose_draft_vocab(counts, 32000)
    d2t, t2d = vocab_maps(draft_ids, vocab)
    if what == "teacher":
        final = torch.randn(rows, hidden, generator=g)
        head = torch.randn(vocab, hidden, generator=g).mul_(0.02)  # in place: no freed [V, H] to reuse
        before = peak_mib()
        teacher_targets(final, head, draft_ids, t2d, chunk=chunk)
    else:
        before = peak_mib()
        draft_ids = choose_draft_vocab(counts, 32000)
        d2t, t2d = vocab_maps(draft_ids, vocab)
    return {"what": what, "vocab": vocab, "hidden": hidden, "rows": rows,
            "chunk_rows": (chunk or logit_rows(vocab)) if what == "teacher" else None,
            "peak_added_mib": peak_mib() - before,
            "output_mib": rows * len(draft_ids) * 4 / 2**20 if what == "teacher" else None}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        what, chunk = args.child.split(":")
        print(json.dumps(measure(what, args.vocab, args.hidden, args.rows, int(chunk) or None)))
        return
    rows = []
    for child in ("teacher:0", "teacher:1024", "vocab map:0"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.teacher_memory", "--vocab", str(args.vocab),
                              "--hidden", str(args.hidden), "--rows", str(args.rows), "--child", child],
                             capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print_table(rows, ["what", "vocab", "hidden", "rows", "chunk_rows", "peak_added_mib", "output_mib"])
    write_result("teacher_memory", rows)


if __name__ == "__main__":
    main()
