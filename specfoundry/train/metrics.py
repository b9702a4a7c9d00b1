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


def merge_metrics(per_micro: list[list[dict]], accel) -> list[dict]:
    """Per TTT step: sum hits/valid over micro-batches and ranks; average losses."""
    merged = []
    for s in range(min(len(m) for m in per_micro)):
        hits = sum(m[s]["hits"] for m in per_micro)
        valid = sum(m[s]["valid"] for m in per_micro)
        loss = sum(m[s]["loss"] for m in per_micro) / len(per_micro)
        stacked = torch.stack([hits.float(), valid.float(), loss.float()])
        if accel.num_processes > 1:
            stacked = accel.reduce(stacked, reduction="sum")
            stacked[2] /= accel.num_processes
        merged.append({"hits": stacked[0], "valid": stacked[1], "loss": stacked[2]})
    return merged


def summarise(metrics: list[dict]) -> dict:
    """Per predicted position s (a TTT step, a block position): loss and accuracy, and the simulated
    acceptance length sum_s prod_{i<=s} acc_i (1 + that is a round's expected tokens)."""
    out, run, tau = {}, 1.0, 0.0
    for s, m in enumerate(metrics):
        acc = (m["hits"].float() / m["valid"].clamp(min=1)).item()
        out[f"loss_{s}"] = m["loss"].item()
        out[f"acc_{s}"] = acc
        run *= acc
        tau += run
    out["sim_accept_len"] = tau
    return out
