"""What a training run reports: per-position losses and accuracies merged over micro-batches and
ranks, the simulated acceptance length, the optimizer state each rank holds, and the trackers
(none, or TensorBoard) that log them."""

from __future__ import annotations

from pathlib import Path

import torch


class NullTracker:
    def log(self, values: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorboardTracker:
    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(logdir))

    def log(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of tensors this rank keeps in the optimizer state."""
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)


PAIRS = ("rates", "means")
"""A family's per-position metrics beyond loss, hits and valid: {name: (numerator, denominator)}
counts summed like hits and valid. `rates` are probabilities of a position's proposal being right
in some sense (a backbone's top-1, a top-K's recall): each is reported per position and chained into
an acceptance length as acc is; `means` are averages (a second loss), reported per position only."""


def merge_metrics(per_micro: list[list[dict]], accel) -> list[dict]:
    """Per TTT step: sum hits/valid (and the numerators and denominators of PAIRS) over micro-batches
    and ranks; average losses."""
    merged = []
    for s in range(min(len(m) for m in per_micro)):
        hits = sum(m[s]["hits"] for m in per_micro)
        valid = sum(m[s]["valid"] for m in per_micro)
        loss = sum(m[s]["loss"] for m in per_micro) / len(per_micro)
        pairs = [(kind, name) for kind in PAIRS for name in per_micro[0][s].get(kind, {})]
        sums = [sum(torch.as_tensor(m[s][kind][name][i]).float() for m in per_micro)
                for kind, name in pairs for i in (0, 1)]
        stacked = torch.stack([hits.float(), valid.float(), loss.float(), *sums])
        if accel.num_processes > 1:
            stacked = accel.reduce(stacked, reduction="sum")
            stacked[2] /= accel.num_processes
        out = {"hits": stacked[0], "valid": stacked[1], "loss": stacked[2]}
        for i, (kind, name) in enumerate(pairs):
            out.setdefault(kind, {})[name] = (stacked[3 + 2 * i], stacked[4 + 2 * i])
        merged.append(out)
    return merged


def summarise(metrics: list[dict]) -> dict:
    """Per predicted position s (a TTT step, a block position): loss and accuracy, and the simulated
    acceptance length sum_s prod_{i<=s} acc_i (1 + that is a round's expected tokens); per position
    each of a family's PAIRS, `{name}_{s}`, and for each rate the acceptance length chained the same
    way from it, `{name}_accept_len`."""
    out, chains = {}, {"sim_accept_len": [1.0, 0.0]}  # name -> [running product, sum]
    for s, m in enumerate(metrics):
        acc = (m["hits"].float() / m["valid"].clamp(min=1)).item()
        out[f"loss_{s}"] = m["loss"].item()
        out[f"acc_{s}"] = acc
        steps = [("sim_accept_len", acc)]
        for kind in PAIRS:
            for name, (num, den) in m.get(kind, {}).items():
                out[f"{name}_{s}"] = (num.float() / den.float().clamp(min=1)).item()
                if kind == "rates":
                    steps.append((f"{name}_accept_len", out[f"{name}_{s}"]))
        for chain, rate in steps:
            run = chains.setdefault(chain, [1.0, 0.0])
            run[0] *= rate
            run[1] += run[0]
    out.update({chain: total for chain, (_, total) in chains.items()})
    return out
