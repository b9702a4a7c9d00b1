"""Fused mixture-of-experts: the routed experts of one MoE layer in two grouped GEMMs, the token
permutation folded into their loads and stores, the gated activation and the routing weight folded
into their epilogues.

transformers' experts layer (the `@use_experts_implementation` classes: Qwen3-MoE, DeepSeek-V3,
GLM-4-MoE, ...) takes x [N, H], top_k_index [N, K] (the expert of each of a token's K slots) and
top_k_weights [N, K], with gate_up_proj [E, 2I, H] (the gate's I rows first: transformers'
concatenated layout) and down_proj [E, H, I], and returns

    y_n = sum_k  w_nk * W_down[e_nk] @ ( act(W_gate[e_nk] @ x_n) * (W_up[e_nk] @ x_n) )      [N, H]

Layout (align_slots; plain torch and no host sync, so the path can be captured in a CUDA graph).
The S = N*K slots s = n*K + k are sorted by expert and each expert's run is padded to a multiple of
BLOCK_M rows, so that every block of BLOCK_M rows belongs to one expert:
    slot_of_row [R]               the slot at each row of the padded order (S on padding rows)
    expert_of_block [R / BLOCK_M] the expert of each block, -1 past the last block in use
R = S + E*(BLOCK_M - 1), rounded up to BLOCK_M, bounds the padded length without reading the
counts back. Slot ids >= E (an expert-parallel rank's sentinels for experts it does not hold) are
left out: their output rows stay zero.

Kernel 1, gate_up (grid: I/BLOCK_N x R/BLOCK_M): a block's A tile is gathered from x row by row
(x[slot // K]: no permuted copy of x is written), multiplied by the block's expert's gate rows and
up rows into two fp32 accumulators, and act(gate) * up is written to h [R, I].
Kernel 2, down (grid: H/BLOCK_N x R/BLOCK_M): h @ W_down[e]^T in fp32, times w[slot], stored into
the slot's own row of out [S, H] (a scatter back to token order); the top-k sum
out.view(N, K, H).sum(1) accumulates in fp32 and rounds once.

Against transformers' grouped_mm path, which writes x[perm] (S x H), gate_up (S x 2I), the
activation (S x I), the down output, its weighted copy and its unpermuted copy (3 x S x H) before
the sum, this writes h (R x I) and out (S x H): at Qwen3-30B-A3B's shape (H 2048, I 768) about
2.5x less activation traffic per layer.

Rounding: both accumulators and the routing product are fp32; h and out are rounded once to the
compute dtype (transformers rounds gate_up, the activation, the down output and the weighted
product, each once). In fp32 (tests) the dots use IEEE fp32, not TF32, so the only difference from
the reference is the summation order of each length-H or length-I dot.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install without the kernels extra: the reference is used
    triton = None

# ---- the plain torch reference -------------------------------------------------------------------

def fused_experts_reference(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                            top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Plain torch, expert by expert, in the input dtype (transformers' eager loop, SiLU-gated):
    x [N, H], gate_up_proj [E, 2I, H], down_proj [E, H, I], top_k_index / top_k_weights [N, K].
    Expert ids >= E (expert-parallel sentinels) contribute nothing."""
    num_experts, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    out = torch.zeros_like(x)  # [N, H]
    for e in range(num_experts):
        token, slot = torch.where(top_k_index == e)  # [M], [M]
        if token.numel() == 0:
            continue
        gu = x[token] @ gate_up_proj[e].T  # [M, 2I]
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]  # [M, I]
        y = (h @ down_proj[e].T) * top_k_weights[token, slot, None]  # [M, H]
        out.index_add_(0, token, y.to(out.dtype))
    return out


# ---- routing: slots sorted by expert, padded per expert to whole blocks --------------------------

def align_slots(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_of_row [R] int32, expert_of_block [R / block_m] int32) as the module docstring says.
    Tensor ops only (scatter_add for the counts, not bincount, whose output size is read back)."""
    device = top_k_index.device
    ids = top_k_index.reshape(-1).long().clamp(max=num_experts)  # [S]; sentinels -> E, sorted last
    slots = ids.numel()
    rows = -(-(slots + num_experts * (block_m - 1)) // block_m) * block_m  # R
    sorted_ids, order = torch.sort(ids, stable=True)  # [S], [S]: slots grouped by expert
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    counts = counts[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    start = torch.cumsum(counts, 0) - counts  # [E] first sorted index of each expert
    padded_end = torch.cumsum(padded, 0)  # [E]
    expert = sorted_ids.clamp(max=num_experts - 1)  # [S]
    row = padded_end[expert] - padded[expert] + torch.arange(slots, device=device) - start[expert]  # [S]
    row = torch.where(sorted_ids < num_experts, row, rows)  # sentinels go to a dump row past the end
    slot_of_row = torch.full((rows + 1,), slots, dtype=torch.int32, device=device)
    slot_of_row.scatter_(0, row, order.to(torch.int32))
    block_start = torch.arange(rows // block_m, device=device) * block_m  # [R / block_m]
    expert_of_block = torch.searchsorted(padded_end, block_start, right=True)  # first e ending after
    expert_of_block = torch.where(expert_of_block < num_experts, expert_of_block, -1).to(torch.int32)
    return slot_of_row[:rows], expert_of_block


# ---- the kernels ----------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ b in fp32. IEEE: fp32 inputs multiplied in fp32, not TF32. UPCAST: bf16/fp16
        tiles widened to fp32 first, for Triton's CPU interpreter, whose bf16 dot returns garbage
        (triton 3.6); on a GPU the tensor cores take them as they are."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, h_ptr, slot_ptr, block_expert_ptr, num_slots,
                        stride_xn, stride_we, stride_wr, stride_hr,
                        TOP_K: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                        IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """h[rows, cols] = silu(x[tok] @ W_gate[e, cols]^T) * (x[tok] @ W_up[e, cols]^T). A padding
        row reads token 0 (in bounds; its h row is written and never read for a slot), so only a
        ragged K or N is masked (EVEN_K: H a multiple of BLOCK_K, EVEN_N: INTER of BLOCK_N; unmasked
        loads need no predicates)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:  # past the last block in use
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        slots = tl.load(slot_ptr + rows)  # [BM]
        valid = slots < num_slots
        tokens = tl.where(valid, slots // TOP_K, 0).to(tl.int64)  # [BM]
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] intermediate columns
        col_ok = cols < INTER
        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
            a_ptrs = x_ptr + tokens[:, None] * stride_xn + ks[None, :]  # [BM, BK]
            gate_ptrs = w_expert + cols[None, :] * stride_wr + ks[:, None]  # [BK, BN]
            up_ptrs = gate_ptrs + INTER * stride_wr
            if EVEN_K and EVEN_N:
                a, w_gate, w_up = tl.load(a_ptrs), tl.load(gate_ptrs), tl.load(up_ptrs)
            else:
                k_ok = ks < H
                w_mask = k_ok[:, None] & col_ok[None, :]
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
                w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
            acc_gate = _dot(a, w_gate, acc_gate, IEEE, UPCAST)
            acc_up = _dot(a, w_up, acc_up, IEEE, UPCAST)
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up  # SiLU(gate) * up, fp32
        # every row, padding rows too (token 0's values: finite, unused), so the down kernel's loads
        # of whole blocks read only written memory
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hr + cols[None, :]
        if EVEN_N:
            tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty))
        else:
            tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=col_ok[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, out_ptr, slot_ptr, block_expert_ptr, weight_ptr, num_slots,
                     stride_hr, stride_we, stride_wr, stride_os,
                     H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
                     UPCAST: tl.constexpr):
        """out[slot, cols] = w[slot] * (h[rows] @ W_down[e, cols]^T), rows scattered to their slots. A
        padding row reads h's own padding row (in bounds, written by _gate_up_kernel; its result is
        never stored), so only a ragged K or N is masked, as in _gate_up_kernel (EVEN_K: INTER a
        multiple of BLOCK_K, EVEN_N: H of BLOCK_N)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(slot_ptr + rows)
        valid = slots < num_slots
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden columns
        col_ok = cols < H
        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hr + ks[None, :]  # [BM, BK]
            w_ptrs = w_expert + cols[None, :] * stride_wr + ks[:, None]  # [BK, BN]
            if EVEN_K and EVEN_N:
                a, w = tl.load(a_ptrs), tl.load(w_ptrs)
            else:
                k_ok = ks < INTER
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = _dot(a, w, acc, IEEE, UPCAST)
        route = tl.load(weight_ptr + slots, mask=valid, other=0.0).to(tl.float32)  # [BM]
        acc = acc * route[:, None]
        safe = tl.where(valid, slots, 0).to(tl.int64)
        tl.store(out_ptr + safe[:, None] * stride_os + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class Tiles:
    """One kernel's column and K tiles and its launch settings."""

    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeLaunch:
    """Both kernels' launch: the row block, shared (align_slots pads each expert's rows to it), and
    each kernel's tiles (benchmarks/moe_tiles.py sweeps them, kernel by kernel)."""

    block_m: int = 64
    gate_up: Tiles = Tiles()
    down: Tiles = Tiles()

    @classmethod
    def uniform(cls, block_m: int, block_n: int, block_k: int, num_warps: int = 4, num_stages: int = 3) -> MoeLaunch:
        """The same tiles for both kernels."""
        tiles = Tiles(block_n, block_k, num_warps, num_stages)
        return cls(block_m, tiles, tiles)


def default_launch(x: torch.Tensor, slots: int, num_experts: int) -> MoeLaunch:
    """Tiles by the rows an expert gets on average: 128-row blocks once most experts fill them
    (prefill of thousands of tokens; each kernel's tiles from the sweep at Qwen3-30B-A3B's layer),
    64 below, 16 under the interpreter (small test shapes)."""
    if x.device.type != "cuda":
        return MoeLaunch.uniform(16, 16, 16, num_warps=1, num_stages=1)
    if slots // max(num_experts, 1) >= 1024:  # the fastest pair of benchmarks/moe_tiles.py's sweep (RESULTS.md)
        return MoeLaunch(128, gate_up=Tiles(128, 64, num_warps=8, num_stages=4),
                         down=Tiles(256, 64, num_warps=8, num_stages=4))
    return MoeLaunch()


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA, or on CPU under its interpreter (TRITON_INTERPRET=1, tests only)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def fused_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, *, sentinels: bool = True, launch: MoeLaunch | None = None
                  ) -> torch.Tensor:
    """The module docstring's y [N, H] by the two kernels. x [N, H] in the weights' dtype;
    gate_up_proj [E, 2I, H] and down_proj [E, H, I] row-major in their last dimension.
    `sentinels`: top_k_index may hold ids >= E (an expert-parallel rank's), whose output rows are
    then zeroed first; False skips that pass (every slot's row is written)."""
    if not triton_available(x.device):
        raise RuntimeError("the fused experts kernel needs a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)")
    num_tokens, hidden = x.shape
    num_experts, two_i, h_in = gate_up_proj.shape
    inter = two_i // 2
    if h_in != hidden or down_proj.shape != (num_experts, hidden, inter):
        raise ValueError(f"expert weights {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)} do not fit "
                         f"hidden states of width {hidden}")
    top_k = top_k_index.shape[-1]
    slots = num_tokens * top_k
    if slots == 0:
        return x.new_zeros(num_tokens, hidden)
    launch = launch or default_launch(x, slots, num_experts)
    out_dtype = x.dtype  # the caller's (under autocast, not the weights')
    x = x.to(gate_up_proj.dtype).contiguous()
    gate_up_proj, down_proj = gate_up_proj.contiguous(), down_proj.contiguous()
    slot_of_row, expert_of_block = align_slots(top_k_index, num_experts, launch.block_m)
    h = torch.empty(slot_of_row.numel(), inter, dtype=x.dtype, device=x.device)  # [R, I]
    out = (torch.zeros if sentinels else torch.empty)(slots, hidden, dtype=x.dtype, device=x.device)  # [S, H]
    routes = Routes(slot_of_row, expert_of_block, top_k_weights.reshape(-1).contiguous(), top_k, launch.block_m)
    # Triton launches on the current device, not the tensors': under a device map the layer's device
    with torch.cuda.device(x.device) if x.device.type == "cuda" else nullcontext():
        launch_gate_up(x, gate_up_proj, h, routes, launch.gate_up)
        launch_down(h, down_proj, out, routes, launch.down)
    slot_rows = out.view(num_tokens, top_k, hidden)
    if out.dtype == out_dtype:  # one reduction: torch sums bf16/fp16 in fp32 and rounds once, as a sum and cast would
        return slot_rows.sum(dim=1)  # [N, H]
    return slot_rows.sum(dim=1, dtype=torch.float32).to(out_dtype)  # (sum(dtype=) would cast each term first)


@dataclass(frozen=True)
class Routes:
    """align_slots' layout of one call, with the slots' routing weights w [S], the top-k K and the row block."""

    slot_of_row: torch.Tensor  # [R] int32
    expert_of_block: torch.Tensor  # [R / block_m] int32
    weights: torch.Tensor  # [S]
    top_k: int
    block_m: int

    @property
    def slots(self) -> int:
        return self.weights.numel()


def _exact_and_interpreted(x: torch.Tensor) -> tuple[bool, bool]:
    """(IEEE: fp32 dots in fp32, not TF32; UPCAST: Triton's CPU interpreter, see _dot)."""
    return x.dtype == torch.float32, x.device.type != "cuda"


def launch_gate_up(x: torch.Tensor, gate_up_proj: torch.Tensor, h: torch.Tensor, routes: Routes, tiles: Tiles) -> None:
    """Kernel 1 into h [R, I] (x [N, H] and gate_up_proj [E, 2I, H] contiguous, in one dtype)."""
    hidden, inter = x.shape[1], h.shape[1]
    ieee, upcast = _exact_and_interpreted(x)
    blocks = routes.slot_of_row.numel() // routes.block_m
    _gate_up_kernel[(triton.cdiv(inter, tiles.block_n), blocks)](
        x, gate_up_proj, h, routes.slot_of_row, routes.expert_of_block, routes.slots,
        x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), h.stride(0),
        TOP_K=routes.top_k, H=hidden, INTER=inter, BLOCK_M=routes.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, EVEN_K=hidden % tiles.block_k == 0, EVEN_N=inter % tiles.block_n == 0,
        IEEE=ieee, UPCAST=upcast, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def launch_down(h: torch.Tensor, down_proj: torch.Tensor, out: torch.Tensor, routes: Routes, tiles: Tiles) -> None:
    """Kernel 2 from h [R, I] into out [S, H] (down_proj [E, H, I] contiguous, h's dtype)."""
    hidden, inter = out.shape[1], h.shape[1]
    ieee, upcast = _exact_and_interpreted(h)
    blocks = routes.slot_of_row.numel() // routes.block_m
    _down_kernel[(triton.cdiv(hidden, tiles.block_n), blocks)](
        h, down_proj, out, routes.slot_of_row, routes.expert_of_block, routes.weights, routes.slots,
        h.stride(0), down_proj.stride(0), down_proj.stride(1), out.stride(0),
        H=hidden, INTER=inter, BLOCK_M=routes.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        EVEN_K=inter % tiles.block_k == 0, EVEN_N=hidden % tiles.block_n == 0,
        IEEE=ieee, UPCAST=upcast, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


# ---- transformers' seam ---------------------------------------------------------------------------

def fused_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward signature: (module, x [N, H], top_k_index, top_k_weights)."""
    return fused_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights,
                         sentinels=expert_parallel(self))


def expert_parallel(module: torch.nn.Module) -> bool:
    """Whether top_k_index may hold another rank's sentinels: the module's `_is_expert_parallel`
    where transformers sets it (5.25 does), else (5.17 sets none) whenever several processes run,
    since expert parallelism needs them. A wrong True costs a zero fill of [S, H], a full write of
    the slot outputs (its share of the block: docs/LOG.md); a wrong False would sum
    unwritten rows."""
    flag = getattr(module, "_is_expert_parallel", None)
    if flag is not None:
        return bool(flag)
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def register_fused_experts(name: str) -> None:
    """Add fused_experts_forward to transformers' ExpertsInterface as `name` (idempotent); the
    commands register it as common/experts.py's FUSED_EXPERTS, which also checks a model's layout."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if ALL_EXPERTS_FUNCTIONS.get(name) is not fused_experts_forward:
        ExpertsInterface.register(name, fused_experts_forward)
