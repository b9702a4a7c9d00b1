"""The main job's closing summary: what was built where, and what the numbers mean.

    python -m specfoundry.summary RUN     (RUN holds regen/, features/, train/, eval/)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summary(run: Path) -> str:
    regen = json.loads((run / "regen" / "manifest.json").read_text())
    features = json.loads((run / "features" / "manifest.json").read_text())
    train = json.loads((run / "train" / "history.json").read_text())
    report = json.loads((run / "eval" / "eval.json").read_text())
    k = report["config"]["k"]
    lines = [
        "",
        f"specfoundry main job: done ({run})",
        f"  {run}/regen     {regen['totals'].get('conversations_written', 0)} conversations answered by the target",
        f"  {run}/features  {features['counts']['samples']} samples, {features['counts']['tokens']} tokens of hidden "
        f"states (layers {features['aux_layer_ids']} + final)",
        f"  {run}/train     {len(train)} optimizer steps; export/ is an EAGLE-3 draft SGLang loads",
        f"  {run}/eval      eval.json, eval.txt, acceptance.png",
    ]
    for name, entry in report["sets"].items():
        trained, floor = entry["trained"], entry.get("untrained")
        lines.append(f"  acceptance length on {name} (k={k}): trained {trained['accept_length']:.2f}"
                     + (f", untrained {floor['accept_length']:.2f}" if floor else "")
                     + f" (tokens per target forward; 1.00 means no draft token accepted, {k + 1} is the most)")
        alone = entry.get("target_alone_tokens_per_s")
        if alone:
            lines.append(f"  tokens/s: {trained['tokens_per_s']:.1f} with the draft, {alone:.1f} target alone. On a "
                         "CPU, verifying k tokens costs nearly k decoding steps, so speed comes on a GPU, where "
                         "verifying them costs about one.")
    lines.append("  the same pipeline at scale on one GPU: bash scripts/pipeline_gpu.sh")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1])))
