"""FlexArgsAttention: EAGLE-3's attention with FlexAttention's launch settings passed in, for the
benchmarks that vary them (attention_breakdown, flex_shapes)."""

from __future__ import annotations

import torch


class FlexArgsAttention(torch.nn.Module):
    """Eagle3Attention's training path (TTT steps through a TTTCache), same weights, with
    tree_attention's launch settings passed in (kernel_options=, compiled=, mask_mod=): the
    model's attention takes none, so a benchmark that varies them puts this in the draft's place.
    separate_qkv: q, k and v from three projections instead of one GEMM over the cached
    concatenated weight (in backward three dX GEMMs and two adds instead of one)."""

    def __init__(self, attn, separate_qkv: bool = False, **flex):
        super().__init__()
        self.attn, self.separate_qkv, self.flex = attn, separate_qkv, flex

    def forward(self, x, cos, sin, cache, lengths, step: int, attention: str) -> torch.Tensor:
        from specfoundry.families.eagle3.model import apply_rotary_pos_emb
        from specfoundry.kernels.tree_attention import tree_attention

        a = self.attn
        b, t, _ = x.shape
        if self.separate_qkv:
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        else:
            q, k, v = torch.nn.functional.linear(x, cache.fused_qkv(a)).split(
                [a.nh * a.hd, a.nkv * a.hd, a.nkv * a.hd], dim=-1)
            v = v.contiguous()  # as the model: a view would keep the whole fused output alive
        q = q.view(b, t, a.nh, a.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = k.view(b, t, a.nkv, a.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = v.view(b, t, a.nkv, a.hd).transpose(1, 2)
        q, k = a.call(apply_rotary_pos_emb, q, k, cos, sin)
        cache.kv.append((k, v))
        keys = torch.cat([c[0] for c in cache.kv], dim=2)  # [B, nkv, T*(step+1), hd]
        values = torch.cat([c[1] for c in cache.kv], dim=2)
        backend = {"flex": "flex", "sdpa": "sdpa"}.get(attention, "auto")
        out = tree_attention(q, keys, values, lengths, step, backend=backend, **self.flex)
        return a.o_proj(out.transpose(1, 2).reshape(b, t, a.nh * a.hd))
