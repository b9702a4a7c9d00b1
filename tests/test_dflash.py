"""DFlash: the mask, attention, draft and loss against references written independently."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specfoundry.families.dflash.anchors import anchor_seed, batch_anchors, sample_anchors
from specfoundry.families.dflash.config import DFlashConfig, dflash_config_from_target
from specfoundry.families.dflash.loss import DFlashModule, dflash_loss
from specfoundry.families.dflash.model import DFlashCache, DFlashDraft
from specfoundry.featureset.batch import Batch
from specfoundry.kernels.dflash_attention import (
    dense_dflash_mask,
    dflash_attention,
    dflash_block_mask,
)

TINY = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, vocab_size=61, target_hidden_size=24,
                    target_layer_ids=(1, 2, 3), block_size=4, mask_token_id=60)

# ---- the mask ------------------------------------------------------------------------------------


def loop_mask(anchors, keep, lengths, ctx_len, block, window=None):
    """The rule spelled out with plain loops: [Bsz, N*B, T + N*B] bool."""
    bsz, n_anchors = len(anchors), len(anchors[0])
    out = torch.zeros(bsz, n_anchors * block, ctx_len + n_anchors * block, dtype=torch.bool)
    for b in range(bsz):
        for n in range(n_anchors):
            a = int(anchors[b][n])
            for t in range(block):
                q = n * block + t
                pos = a + t
                for j in range(ctx_len):  # context keys
                    seen = bool(keep[b][n]) and j < a and j < lengths[b]
                    if window is not None and pos - j >= window:
                        seen = False
                    out[b, q, j] = seen
                for m in range(n_anchors):  # block keys
                    for u in range(block):
                        seen = m == n
                        if window is not None and not (u <= t and t - u < window):
                            seen = False
                        out[b, q, ctx_len + m * block + u] = seen
    return out


MASK_CASES = [
    # anchors, keep, lengths, T, B, window
    ([[0, 2, 3]], [[1, 1, 1]], [6], 6, 4, None),  # a = 0 (no context) and overlapping blocks
    ([[1, 5, 3]], [[1, 1, 0]], [6], 6, 3, None),  # a = length - 1 (block past the end), a padding anchor
    ([[0, 3, 4], [2, 0, 0]], [[1, 1, 1], [1, 0, 0]], [7, 4], 7, 2, None),  # rows of different lengths
    ([[0, 2, 5], [1, 3, 0]], [[1, 1, 1], [1, 1, 0]], [8, 5], 8, 4, 3),  # sliding window 3
    ([[4, 9, 12]], [[1, 1, 1]], [13], 13, 5, 1),  # window 1: each slot sees only itself
]


@pytest.mark.parametrize("anchors,keep,lengths,ctx_len,block,window", MASK_CASES)
def test_mask_equals_loop_reference(anchors, keep, lengths, ctx_len, block, window):
    a, k = torch.tensor(anchors), torch.tensor(keep, dtype=torch.bool)
    dense = dense_dflash_mask(a, k, lengths, ctx_len, block, window)[:, 0]
    assert torch.equal(dense, loop_mask(anchors, keep, lengths, ctx_len, block, window))
    assert dense.any(-1).all()  # no query row without a key: no NaN


def tiles(num, indices, nq, nkv):
    """BlockMask's (num [B, 1, nq], indices [B, 1, nq, nkv]) back to a [B, nq, nkv] bool occupancy."""
    out = torch.zeros(num.shape[0], nq, nkv, dtype=torch.bool)
    for b in range(num.shape[0]):
        for i in range(nq):
            for j in indices[b, 0, i, : num[b, 0, i]].tolist():
                out[b, i, j] = True
    return out


@pytest.mark.parametrize("window,block,ctx_len", [(None, 16, 300), (None, 5, 211), (40, 16, 300), (7, 5, 211)])
def test_block_mask_tiles_cover_the_dense_mask(window, block, ctx_len):
    """Several 128-tiles, blocks that do not align with them (B = 5), a padding tail and a short
    row. A tile is listed iff the dense mask has a True in it (full layers; sliding ones may list
    more), and a tile listed as full is True everywhere."""
    g = torch.Generator().manual_seed(1)
    n = 40
    lengths = [ctx_len, 150]
    anchors = torch.stack([torch.randperm(length - 1, generator=g)[:n].sort().values for length in lengths])
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[1, 30:] = False
    anchors[1, 30:] = 0
    dense = dense_dflash_mask(anchors, keep, lengths, ctx_len, block, window)[:, 0]
    mask = dflash_block_mask(anchors, keep, lengths, ctx_len, block, window)
    nq, nkv = -(-n * block // 128), -(-(ctx_len + n * block) // 128)
    partial = tiles(mask.kv_num_blocks, mask.kv_indices, nq, nkv)
    full = tiles(mask.full_kv_num_blocks, mask.full_kv_indices, nq, nkv)
    assert not (partial & full).any()
    for b in range(2):
        for i in range(nq):
            for j in range(nkv):
                tile = dense[b, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                listed = bool(partial[b, i, j] or full[b, i, j])
                assert listed == bool(tile.any()) if window is None else listed >= bool(tile.any()), (b, i, j)
                if full[b, i, j]:
                    assert tile.all() and tile.shape == (128, 128), (b, i, j)
    if window is not None:
        assert not full.any()  # sliding layers leave the window to the mask_mod
    elif block == 16:
        assert full.any()  # full layers skip the mask in whole context tiles
    torch.testing.assert_close(mask.to_dense()[:, 0].bool(), partial | full)


def test_hand_checked_mask():
    """Context c0..c3, B = 2, anchors 0 and 2: block 0 sees no context (its anchor is the first
    token), block 1 sees c0, c1 (strictly before its anchor); each block sees only itself."""
    expected = torch.tensor([
        # c0 c1 c2 c3 | 0.0 0.1 1.0 1.1
        [0, 0, 0, 0, 1, 1, 0, 0],  # block 0, slot 0 (position 0)
        [0, 0, 0, 0, 1, 1, 0, 0],  # block 0, slot 1
        [1, 1, 0, 0, 0, 0, 1, 1],  # block 1, slot 0 (position 2)
        [1, 1, 0, 0, 0, 0, 1, 1],  # block 1, slot 1
    ], dtype=torch.bool)
    anchors, keep = torch.tensor([[0, 2]]), torch.tensor([[True, True]])
    assert torch.equal(dense_dflash_mask(anchors, keep, [4], 4, 2)[0, 0], expected)
    padded = expected.clone()
    padded[2:, :4] = False  # a padding anchor (keep False) sees only its own block
    assert torch.equal(dense_dflash_mask(anchors, torch.tensor([[True, False]]), [4], 4, 2)[0, 0], padded)
    sliding = torch.tensor([
        [0, 0, 0, 0, 1, 0, 0, 0],  # position 0: itself
        [0, 0, 0, 0, 1, 1, 0, 0],  # position 1: slot 0 and itself
        [0, 1, 0, 0, 0, 0, 1, 0],  # position 2: c1 and itself (window 2)
        [0, 0, 0, 0, 0, 0, 1, 1],  # position 3: slot 0 (position 2) and itself
    ], dtype=torch.bool)
    assert torch.equal(dense_dflash_mask(anchors, keep, [4], 4, 2, sliding_window=2)[0, 0], sliding)


# ---- attention -----------------------------------------------------------------------------------


def reference_attention(q, k, v, mask):
    """float64 softmax attention over the allowed keys, with explicit loops over the query rows."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    rows = []
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            keys = mask[b, i].nonzero().flatten()
            scores = (k[b, :, keys] @ q[b, :, i, :, None].double()).squeeze(-1) / q.shape[-1] ** 0.5  # [H, keys]
            rows.append(torch.softmax(scores, -1)[:, None] @ v[b, :, keys])  # [H, 1, D]
    return torch.cat(rows, 1).view(q.shape[1], q.shape[0], q.shape[2], -1).transpose(0, 1)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("window", [None, 3])
def test_dense_attention_and_gradients_match_reference(hq, hkv, window):
    anchors, keep, lengths, ctx_len, block = [[0, 3, 6], [1, 2, 0]], [[1, 1, 1], [1, 1, 0]], [7, 4], 7, 5
    a, kp = torch.tensor(anchors), torch.tensor(keep, dtype=torch.bool)
    q = torch.randn(2, hq, 3 * block, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hkv, ctx_len + 3 * block, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    out = dflash_attention(q, k, v, a, kp, lengths, block, backend="sdpa", sliding_window=window)
    ref = reference_attention(q, k, v, loop_mask(anchors, keep, lengths, ctx_len, block, window))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-9)


@pytest.mark.slow  # compiles flex_attention for the CPU
@pytest.mark.parametrize("window", [None, 30])
def test_flex_forward_matches_dense_on_cpu_without_recompiling(window):
    n, block, ctx_len = 16, 16, 200
    q = torch.randn(2, 4, n * block, 16)
    k = torch.randn(2, 2, ctx_len + n * block, 16)
    v = torch.randn_like(k)
    for step in range(2):  # new anchors: the compiled attention is reused
        g = torch.Generator().manual_seed(step)
        anchors = torch.stack([torch.randperm(190, generator=g)[:n].sort().values for _ in range(2)])
        keep = torch.ones(2, n, dtype=torch.bool)
        keep[1, 10:] = False
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=step > 0):
            out = dflash_attention(q, k, v, anchors, keep, [200, 150], block, backend="flex", sliding_window=window)
        ref = dflash_attention(q, k, v, anchors, keep, [200, 150], block, backend="sdpa", sliding_window=window)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 256])
def test_flex_matches_dense_on_gpu_without_recompiling(window):
    torch.manual_seed(0)
    bsz, n, block, ctx_len, hq, hkv, d = 2, 64, 16, 1000, 32, 8, 128
    lengths = [1000, 700]

    def anchors_for(seed):
        g = torch.Generator().manual_seed(seed)
        a = torch.stack([torch.randperm(length - 1, generator=g)[:n].sort().values for length in lengths])
        keep = torch.ones(bsz, n, dtype=torch.bool)
        keep[1, 50:] = False
        return a.cuda(), keep.cuda()

    q = torch.randn(bsz, hq, n * block, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(bsz, hkv, ctx_len + n * block, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    for step in range(3):  # new anchors every step: neither the builder nor the kernel recompiles
        anchors, keep = anchors_for(step)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            out = dflash_attention(q, k, v, anchors, keep, lengths, block, backend="flex", sliding_window=window)
        ref = dflash_attention(q.float(), k.float(), v.float(), anchors, keep, lengths, block, backend="sdpa",
                               sliding_window=window)
        # bf16 inputs, fp32 accumulation in both; outputs are rounded to bf16 (2^-8 relative)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        up = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), up)
        want = torch.autograd.grad(ref, (q, k, v), up.float())
        for a, e in zip(got, want, strict=True):
            err = (a.float() - e).norm() / e.norm()
            assert err < 1e-2, err  # relative error of bf16 operands


# ---- the draft -----------------------------------------------------------------------------------


def sglang_names(num_layers: int) -> set[str]:
    """SGLang's DFlashDraftModel checkpoint: 11 tensors per layer, fc, hidden_norm and norm."""
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    names = {f"layers.{i}.{p}.weight" for i in range(num_layers) for p in per_layer}
    return names | {"fc.weight", "hidden_norm.weight", "norm.weight"}


@pytest.mark.parametrize("layers", [1, 3])
def test_state_dict_names_are_sglangs(layers):
    cfg = DFlashConfig.from_dict({**TINY.to_dict(), "num_hidden_layers": layers})
    model = DFlashDraft(cfg)
    params = {n for n, _ in model.named_parameters()}
    assert params == sglang_names(layers)
    assert len(params) == 11 * layers + 3
    assert set(model.state_dict()) == params  # embed_tokens: the target's, a buffer outside the state dict
    assert model.state_dict()["fc.weight"].shape == (32, 3 * 24)


def random_draft(cfg=TINY, seed=0):
    """A draft whose norms are not all ones (so a misplaced norm shows)."""
    torch.manual_seed(seed)
    model = DFlashDraft(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


SLIDING = DFlashConfig.from_dict({**TINY.to_dict(), "layer_types": ["full_attention", "sliding_attention"],
                                  "sliding_window": 3})


@pytest.mark.parametrize("cfg", [TINY, SLIDING], ids=["full", "sliding"])
def test_train_forward_equals_decode_block(cfg):
    """Every anchored block of a training pass (two rows of different lengths, overlapping blocks,
    a = 0, a block past the end, a padding anchor) equals decoding that block alone after a cache
    of the context before its anchor."""
    model = random_draft(cfg)
    b = cfg.block_size
    lengths, width = [12, 7], 12
    aux = torch.randn(2, width, 3 * cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size - 1, (2, width))
    anchors = torch.tensor([[0, 3, 5, 11], [2, 6, 0, 0]])
    keep = torch.tensor([[True, True, True, True], [True, True, False, False]])
    block_ids = ids.gather(1, anchors)[:, :, None].repeat(1, 1, b)
    block_ids[:, :, 1:] = cfg.mask_token_id
    positions = anchors[:, :, None] + torch.arange(b)
    with torch.no_grad():
        context = model.project_context(aux)
        states = model.train_forward(context, block_ids.flatten(1), positions.flatten(1), anchors, keep, lengths,
                                     attention="sdpa")
        assert states.shape == (2, 4 * b, cfg.hidden_size)
        for r in range(2):
            for n in range(4):
                if not keep[r, n]:
                    continue
                a = int(anchors[r, n])
                cache = DFlashCache()
                if a:
                    cache.append_context(model, context[r : r + 1, :a])
                out = model.decode_block(block_ids[r : r + 1, n], positions[r : r + 1, n], cache)
                torch.testing.assert_close(out[0], states[r, n * b : (n + 1) * b], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(states).all()  # padding anchors too


def spec_block(model, aux, block_ids, anchor):
    """The forward of one block as the spec's §3 writes it, from the weights by name in float64:
    context c = hidden_norm(fc(aux)) before the anchor (never input_layernorm'ed); per layer q, k
    per-head RMSNormed then RoPE'd (neox halves), keys/values [context | block], non-causal
    softmax; residual pre-norm blocks; final norm. aux [T, K*Ht]; block_ids [B]. Returns [B, H]."""
    cfg, w = model.cfg, {k: v.double() for k, v in model.state_dict().items()}
    nh, nkv, hd, b = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, len(block_ids)

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rope(x, pos):  # x [s, n, hd], pos [s]
        inv = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # [hd/2]
        ang = torch.cat([pos[:, None] * inv] * 2, -1)[:, None]  # [s, 1, hd]
        rotated = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * ang.cos() + rotated * ang.sin()

    ctx_pos, blk_pos = torch.arange(anchor, dtype=torch.float64), torch.arange(anchor, anchor + b, dtype=torch.float64)
    c = rms(aux.double() @ w["fc.weight"].T, w["hidden_norm.weight"])[:anchor]  # [a, H]
    h = model.embed_tokens.weight.double()[block_ids]  # [B, H] (a buffer outside the state dict)
    for i in range(cfg.num_hidden_layers):
        p = {k.split(f"layers.{i}.")[1]: v for k, v in w.items() if k.startswith(f"layers.{i}.")}
        x = rms(h, p["input_layernorm.weight"])
        q = rope(rms((x @ p["self_attn.q_proj.weight"].T).view(b, nh, hd), p["self_attn.q_norm.weight"]), blk_pos)
        keys = [rope(rms((y @ p["self_attn.k_proj.weight"].T).view(len(y), nkv, hd), p["self_attn.k_norm.weight"]),
                     pos) for y, pos in ((c, ctx_pos), (x, blk_pos))]
        k = torch.cat(keys).repeat_interleave(nh // nkv, 1)  # [a + B, nh, hd]: kv head j serves q heads j*rep..
        v = torch.cat([c, x]) @ p["self_attn.v_proj.weight"].T
        v = v.view(-1, nkv, hd).repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / hd**0.5, -1)  # every key: non-causal
        h = h + torch.einsum("hqk,khd->qhd", att, v).reshape(b, nh * hd) @ p["self_attn.o_proj.weight"].T
        y = rms(h, p["post_attention_layernorm.weight"])
        h = h + (F.silu(y @ p["mlp.gate_proj.weight"].T) * (y @ p["mlp.up_proj.weight"].T)) @ p["mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"])


@pytest.mark.parametrize("anchor", [0, 1, 6])
def test_decode_block_follows_the_spec(anchor):
    model = random_draft()
    aux = torch.randn(9, 72)
    ids = torch.tensor([7] + [TINY.mask_token_id] * 3)
    cache = DFlashCache()
    with torch.no_grad():
        context = model.project_context(aux[None])
        if anchor:
            cache.append_context(model, context[:, :anchor])
        out = model.decode_block(ids[None], torch.arange(anchor, anchor + 4)[None], cache)[0]
    torch.testing.assert_close(out.double(), spec_block(model, aux, ids, anchor), atol=2e-5, rtol=1e-5)


def test_cache_appends_in_pieces_and_crops():
    """Context appended round by round, then a rejected tail cropped away, equals the context
    appended at once; decode_block leaves the cache as it was."""
    model = random_draft()
    context = model.project_context(torch.randn(1, 10, 72)).detach()
    block = torch.tensor([[5] + [TINY.mask_token_id] * 3])
    whole, pieces = DFlashCache(), DFlashCache()
    with torch.no_grad():
        whole.append_context(model, context[:, :8])
        pieces.append_context(model, context[:, :3])
        pieces.append_context(model, context[:, 3:10])
        pieces.crop(8)
        assert len(pieces) == len(whole) == 8
        positions = torch.arange(8, 12)[None]
        a = model.decode_block(block, positions, whole)
        b = model.decode_block(block, positions, pieces)
    assert len(whole) == 8
    # appended in two pieces (matmuls of 3 and 7 rows) against one of 8: other BLAS blocking of sums
    # over H = 32, ~sqrt(32) * 1.2e-7 * 2.5 (the largest value) = 2e-6; a wrong crop moves them by O(1)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert whole.kv.keys.keys() == pieces.kv.keys.keys() and len(whole.kv.keys) == TINY.num_hidden_layers
    for layer, k1 in whole.kv.keys.items():
        k1, k2 = k1[:, :, :8], pieces.kv.keys[layer][:, :, :8]  # the committed columns
        assert k1.shape == (1, TINY.num_key_value_heads, 8, TINY.head_dim)
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=0)  # (as above)


def test_context_is_strictly_before_the_anchor():
    """Changing the feature at the anchor's own position (or later) changes nothing in its block;
    changing one before it does."""
    model = random_draft()
    aux = torch.randn(1, 9, 72)
    anchors, keep = torch.tensor([[5]]), torch.tensor([[True]])
    ids = torch.tensor([[3, 60, 60, 60]])
    positions = torch.arange(5, 9)[None]

    def run(x):
        with torch.no_grad():
            return model.train_forward(model.project_context(x), ids, positions, anchors, keep, [9], "sdpa")

    base = run(aux)
    later = aux.clone()
    later[:, 5:] += 1.0
    torch.testing.assert_close(run(later), base, atol=0, rtol=0)
    earlier = aux.clone()
    earlier[:, 4] += 1.0
    assert (run(earlier) - base).abs().max() > 1e-3


# ---- anchors -------------------------------------------------------------------------------------


def candidates_by_loop(loss_mask, length):
    return [a for a in range(length) if a + 1 < length and loss_mask[a] and loss_mask[a + 1]]


def test_anchor_rule_count_and_order():
    g = torch.Generator().manual_seed(3)
    loss_mask = torch.rand(40, generator=g) > 0.4
    length = 33  # positions past it are padding, whatever the mask says there
    loss_mask[33:] = True
    cand = candidates_by_loop(loss_mask.tolist(), length)
    assert 5 < len(cand) < 30
    few = sample_anchors(loss_mask, length, 4, 5, seed=11)
    assert len(few) == 5 and few.dtype == torch.int64
    assert set(few.tolist()) <= set(cand)
    assert torch.all(few[1:] > few[:-1])  # sorted and distinct
    every = sample_anchors(loss_mask, length, 4, 1000, seed=11)
    assert every.tolist() == cand  # more slots than candidates: all of them, once each


def test_anchors_are_deterministic_and_leave_the_global_rng_alone():
    loss_mask = torch.ones(200, dtype=torch.bool)
    state = torch.get_rng_state()
    a = sample_anchors(loss_mask, 200, 16, 20, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, sample_anchors(loss_mask, 200, 16, 20, seed=5))
    assert not torch.equal(a, sample_anchors(loss_mask, 200, 16, 20, seed=6))


def test_no_anchors_when_nothing_is_supervised():
    assert sample_anchors(torch.zeros(30, dtype=torch.bool), 30, 4, 8, seed=0).numel() == 0
    alternate = torch.arange(30) % 2 == 0  # never two supervised tokens in a row
    assert sample_anchors(alternate, 30, 4, 8, seed=0).numel() == 0
    last = torch.zeros(30, dtype=torch.bool)
    last[28:] = True  # 28 and 29 supervised, but a + 1 = 29 < length 30 only for a = 28
    assert sample_anchors(last, 30, 4, 8, seed=0).tolist() == [28]
    assert sample_anchors(last, 29, 4, 8, seed=0).numel() == 0


def test_anchor_seed_mixes_all_three_numbers():
    seeds = {anchor_seed(s, e, i) for s in range(3) for e in range(3) for i in range(50)}
    assert len(seeds) == 3 * 3 * 50  # no collisions among neighbours
    assert anchor_seed(1, 2, 3) == anchor_seed(1, 2, 3)
    assert all(0 <= x < 2**63 for x in seeds)


def make_batch(lengths, width=None, cfg=TINY, seed=0, indices=None, epoch=0):
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    bsz = len(lengths)
    ids = torch.randint(0, cfg.vocab_size - 1, (bsz, width), generator=g)
    mask = torch.rand(bsz, width, generator=g) > 0.2
    for r, n in enumerate(lengths):
        mask[r, n:] = False
    aux = torch.randn(bsz, width, len(cfg.target_layer_ids) * cfg.target_hidden_size, generator=g)
    final = torch.randn(bsz, width, cfg.hidden_size, generator=g)
    return Batch(ids, mask, aux, final, list(lengths), list(range(bsz)) if indices is None else indices, epoch)


def test_batch_anchors_do_not_depend_on_the_batching():
    """A sample's anchors are the same whatever its row and batch-mates; dummy rows get none."""
    alone = make_batch([15], seed=1, indices=[7])
    other = make_batch([11], width=15, seed=2, indices=[3])
    together = Batch(torch.cat([other.input_ids, alone.input_ids]), torch.cat([other.loss_mask, alone.loss_mask]),
                     torch.cat([other.aux_hidden, alone.aux_hidden]), None, [11, 15, 1], [3, 7], 0)
    together.input_ids = torch.cat([together.input_ids, torch.zeros(1, 15, dtype=torch.int64)])
    together.loss_mask = torch.cat([together.loss_mask, torch.ones(1, 15, dtype=torch.bool)])  # a dummy row
    a1, k1 = batch_anchors(alone, 6, 4, seed=9)
    a2, k2 = batch_anchors(together, 6, 4, seed=9)
    assert k1.sum() == 6
    assert torch.equal(a1[0][k1[0]], a2[1][k2[1]])
    assert not k2[2].any()  # the dummy row: no sample index, no anchors
    a3, _ = batch_anchors(make_batch([15], seed=1, indices=[7], epoch=1), 6, 4, seed=9)
    assert not torch.equal(a3, a1)  # a new epoch draws anew


# ---- the loss ------------------------------------------------------------------------------------


def reference_loss(model, batch, head, *, num_anchors, gamma, seed, teacher, row_loss=None):
    """The loss spelled out block by block through the decoding path (a cache of the context
    before each anchor, then decode_block) and full logits, the draft's own (block_logits, given
    each slot and its block's true tokens): (loss, {k: [ce of each valid slot]}). row_loss(logits
    [V], p [V]): another token loss in the soft CE's place (tests/test_objectives.py's LK losses)."""
    b = model.cfg.block_size
    context = model.project_context(batch.aux_hidden)
    num, den, per_slot = 0.0, 0.0, {k: [] for k in range(1, b)}
    for r, index in enumerate(batch.indices):
        n = batch.lengths[r]
        seed_r = anchor_seed(seed, batch.epoch, index)
        for a in sample_anchors(batch.loss_mask[r], n, b, num_anchors, seed_r).tolist():
            cache = DFlashCache()
            if a:
                cache.append_context(model, context[r : r + 1, :a])
            ids = torch.tensor([[int(batch.input_ids[r, a])] + [model.cfg.mask_token_id] * (b - 1)])
            states = model.decode_block(ids, torch.arange(a, a + b)[None], cache)[0]  # [B, H]
            tokens = batch.input_ids[r, torch.arange(a, a + b).clamp(max=batch.input_ids.shape[1] - 1)]
            # [B-1, V]: row k-1 is slot k's
            logits = model.block_logits(states[1:], head, torch.arange(1, b), tokens.expand(b - 1, b))
            for k in range(1, b):
                if not (a + k < n and batch.loss_mask[r, a + k]):
                    continue
                if teacher == "hard":
                    ce = F.cross_entropy(logits[k - 1], batch.input_ids[r, a + k])
                else:
                    p = torch.softmax(batch.final_hidden[r, a + k - 1] @ head.T, -1)
                    ce = (row_loss(logits[k - 1], p) if row_loss is not None
                          else -(p * torch.log_softmax(logits[k - 1], -1)).sum())
                w = math.exp(-(k - 1) / gamma) if gamma > 0 else 1.0
                num, den = num + w * ce, den + w
                per_slot[k].append(ce.detach())
    return num / den, per_slot


def loss_and_grads(model, fn):
    model.zero_grad()
    loss = fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("teacher,gamma,loss_kernel", [("hard", 7.0, "auto"), ("hard", 0.0, "auto"),
                                                       ("soft", 2.0, "reference"), ("soft", 7.0, "auto")])
def test_loss_and_gradients_match_the_block_by_block_reference(teacher, gamma, loss_kernel):
    model = random_draft()
    head = torch.randn(TINY.vocab_size, TINY.hidden_size)
    batch = make_batch([14, 9], seed=4)
    kw = dict(num_anchors=5, gamma=gamma, seed=3)
    out = {}

    def ours():
        out["loss"], out["metrics"] = dflash_loss(model, batch, head, teacher=teacher, label_chunk=2,
                                                  loss_kernel=loss_kernel, attention="sdpa", **kw)
        return out["loss"]

    loss, grads = loss_and_grads(model, ours)
    metrics = out["metrics"]
    ref_loss, ref_grads = loss_and_grads(model, lambda: reference_loss(model, batch, head, teacher=teacher, **kw)[0])
    with torch.no_grad():
        per_slot = reference_loss(model, batch, head, teacher=teacher, **kw)[1]
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    assert len(metrics) == TINY.block_size - 1
    for k, m in enumerate(metrics, start=1):
        assert set(m) == {"loss", "hits", "valid"}
        assert int(m["valid"]) == len(per_slot[k]) and 0 <= int(m["hits"]) <= int(m["valid"])
        assert not m["hits"].dtype.is_floating_point
        if per_slot[k]:
            torch.testing.assert_close(m["loss"], torch.stack(per_slot[k]).mean(), atol=1e-5, rtol=1e-5)
    assert sum(int(m["valid"]) for m in metrics) > 10


def topk_teacher_batch(batch, head, k):
    """The batch with its final states replaced by their top-k teacher (featureset/teacher.py's form,
    kept in fp32 here so that only the top k and the renormalisation differ from the dense teacher)."""
    from dataclasses import replace

    probs, ids = torch.softmax(batch.final_hidden @ head.T, -1).topk(k, dim=-1)  # [B, T, k] most probable first
    return replace(batch, final_hidden=None, teacher_ids=ids.int(), teacher_probs=probs)


@pytest.mark.parametrize("objective,loss_kernel,token_loss", [("dflash", "reference", "ce"), ("dflash", "auto", "ce"),
                                                               ("dpace", "reference", "ce"),
                                                               ("dflash", "reference", "lk-lambda")])
def test_the_soft_teacher_from_every_token_kept_is_the_dense_one(objective, loss_kernel, token_loss):
    """--teacher soft from a set storing a top-k teacher (issue 59): with every token kept (k = V) the
    loss and gradients are those of the final state's teacher. The stored probabilities are the same
    fp32 softmax, summing to 1 within V fp32 roundings (61 * 6e-8 relative), far inside rtol 1e-5."""
    from specfoundry.kernels.lk_loss import TokenLoss

    model = random_draft()
    head = torch.randn(TINY.vocab_size, TINY.hidden_size)
    dense = make_batch([14, 9], seed=4)
    kw = dict(num_anchors=5, gamma=2.0, seed=3, teacher="soft", label_chunk=2, attention="sdpa", objective=objective,
              loss_kernel=loss_kernel, token_loss=TokenLoss(token_loss))
    runs = [loss_and_grads(model, lambda b=b: dflash_loss(model, b, head, **kw)[0])
            for b in (dense, topk_teacher_batch(dense, head, TINY.vocab_size))]
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=1e-6, rtol=1e-5)
    for name, g in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], g, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("headed", [False, True])
def test_the_soft_teacher_from_k_kept_tokens_is_their_renormalised_distribution(headed):
    """With k < V kept, the soft CE is the block-by-block reference's against the teacher's k most
    probable tokens' probabilities divided by their sum (zero elsewhere), through the plain head's
    kernel and through a head with parameters (autograd)."""
    model = HeadedDraft(TINY) if headed else random_draft()
    if headed:
        model.load_state_dict(random_draft().state_dict(), strict=False)
    head = torch.randn(TINY.vocab_size, TINY.hidden_size)
    batch = make_batch([14, 9], seed=4)
    kw = dict(num_anchors=5, gamma=2.0, seed=3)

    def kept(logits, p):  # the reference's row loss against the renormalised top 5 of p
        top = p.topk(5)
        q = torch.zeros_like(p).scatter_(0, top.indices, top.values / top.values.sum())
        return -(q * torch.log_softmax(logits, -1)).sum()

    loss, grads = loss_and_grads(model, lambda: dflash_loss(model, topk_teacher_batch(batch, head, 5), head,
                                                            teacher="soft", label_chunk=2, attention="sdpa",
                                                            loss_kernel="reference", **kw)[0])
    ref, ref_grads = loss_and_grads(model, lambda: reference_loss(model, batch, head, teacher="soft", row_loss=kept,
                                                                  **kw)[0])
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


class HeadedDraft(DFlashDraft):
    """A draft with a head of its own, teacher-forced as Domino's is: a learned logit bias from the
    token before each slot (the anchor for slot 1)."""

    plain_head = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.prev_bias = torch.nn.Parameter(torch.zeros(cfg.vocab_size, cfg.vocab_size))

    def block_logits(self, states, head, slots=None, tokens=None):
        prev = tokens.gather(1, (slots - 1)[:, None])[:, 0]  # [rows]
        return super().block_logits(states, head) + self.prev_bias[prev].to(states.dtype)


@pytest.mark.parametrize("teacher", ["hard", "soft"])
def test_a_head_with_parameters_trains_through_the_drafts_logits(teacher):
    """The loss reads the draft's block_logits: a head with parameters gets the gradient of the
    full-logits reference, and with its parameters at zero equals the plain draft's hand-written path."""
    plain = random_draft()
    headed = HeadedDraft(TINY)
    headed.load_state_dict(plain.state_dict(), strict=False)
    headed.embed_tokens.weight.copy_(plain.embed_tokens.weight)  # a buffer outside the state dict
    head = torch.randn(TINY.vocab_size, TINY.hidden_size)
    batch = make_batch([14, 9], seed=4)
    kw = dict(num_anchors=5, gamma=2.0, seed=3, teacher=teacher)
    loss0, grads0 = loss_and_grads(headed, lambda: dflash_loss(headed, batch, head, label_chunk=2, attention="sdpa",
                                                                **kw)[0])
    ref0, plain_grads = loss_and_grads(plain, lambda: dflash_loss(plain, batch, head, label_chunk=2, attention="sdpa",
                                                                   loss_kernel="reference", **kw)[0])
    torch.testing.assert_close(loss0, ref0, atol=1e-5, rtol=1e-5)
    for name, g in plain_grads.items():
        torch.testing.assert_close(grads0[name], g, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():
        headed.prev_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(headed, lambda: dflash_loss(headed, batch, head, label_chunk=2, attention="sdpa",
                                                              **kw)[0])
    ref_loss, ref_grads = loss_and_grads(headed, lambda: reference_loss(headed, batch, head, **kw)[0])
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert grads["prev_bias"].abs().sum() > 0
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_slot_weights_by_hand():
    """One anchor whose three slots are all scored: loss = sum_k w_k ce_k / sum_k w_k with
    w = (1, e^-1/2, e^-1) at gamma = 2, and the plain mean at gamma = 0."""
    model = random_draft()
    head = torch.randn(TINY.vocab_size, TINY.hidden_size)
    batch = make_batch([8], seed=5)
    batch.loss_mask[:] = False
    batch.loss_mask[0, [2, 3, 5]] = True  # the only anchor is 2; its slots 1..3 predict positions 3, 4, 5
    with torch.no_grad():
        loss, metrics = dflash_loss(model, batch, head, num_anchors=4, gamma=2.0, attention="sdpa")
        flat, _ = dflash_loss(model, batch, head, num_anchors=4, gamma=0.0, attention="sdpa")
    assert [int(m["valid"]) for m in metrics] == [1, 0, 1]  # positions 3 and 5; 4 is unsupervised
    ce1, ce3 = float(metrics[0]["loss"]), float(metrics[2]["loss"])
    w1, w3 = 1.0, math.exp(-1.0)
    assert loss.item() == pytest.approx((w1 * ce1 + w3 * ce3) / (w1 + w3), rel=1e-6)
    assert flat.item() == pytest.approx((ce1 + ce3) / 2, rel=1e-6)
    assert abs(ce1 - ce3) > 1e-3  # otherwise the weights would not show


def test_loss_decreases_when_overfitting_a_tiny_batch():
    model = random_draft()
    head = torch.randn(TINY.vocab_size, TINY.hidden_size)
    batch = make_batch([16, 12], seed=6)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, metrics = dflash_loss(model, batch, head, num_anchors=6, attention="sdpa")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.1 * losses[0], losses
    hits = sum(int(m["hits"]) for m in metrics)
    assert hits >= 0.9 * sum(int(m["valid"]) for m in metrics)


def test_announced_loss_scale_and_eval_mode():
    """The announced gradient (loss_scale) is only a hint: the gradients of (loss * s) are the same
    whatever was announced; without gradients the value is the same."""
    model = random_draft()
    head = torch.randn(TINY.vocab_size, TINY.hidden_size)
    batch = make_batch([13, 10], seed=7)
    kw = dict(num_anchors=5, attention="sdpa")
    _, base = loss_and_grads(model, lambda: dflash_loss(model, batch, head, **kw)[0])
    for announced, actual in [(0.25, 0.25), (1.0, 0.25), (0.5, 2.0)]:
        loss, grads = loss_and_grads(model, lambda a=announced, s=actual: dflash_loss(
            model, batch, head, loss_scale=a, **kw)[0] * s)
        for name, g in grads.items():
            torch.testing.assert_close(g, base[name] * actual, atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():
        value, _ = dflash_loss(model, batch, head, **kw)
    torch.testing.assert_close(value, loss / 2.0)


def test_module_forward_and_dummy_rows():
    """DFlashModule is dflash_loss with its options; a dummy row (no sample index, length 1) changes
    nothing; the target's head is a buffer that is never saved."""
    model = random_draft()
    head = torch.randn(TINY.vocab_size, TINY.hidden_size)
    module = DFlashModule(model, head, num_anchors=5, gamma=4.0, seed=2)
    assert "lm_head" not in module.state_dict()
    assert {n for n, _ in module.named_parameters()} == {f"draft.{n}" for n in sglang_names(2)}
    batch = make_batch([11, 9], seed=8)
    loss, metrics = module(batch, attention="sdpa")
    ref, _ = dflash_loss(model, batch, head, num_anchors=5, gamma=4.0, seed=2, attention="sdpa")
    torch.testing.assert_close(loss, ref, atol=0, rtol=0)
    padded = make_batch([11, 9, 1], seed=8, indices=[0, 1])
    padded.input_ids[:2], padded.loss_mask[:2], padded.aux_hidden[:2] = batch.input_ids, batch.loss_mask, batch.aux_hidden
    loss2, metrics2 = module(padded, attention="sdpa")
    torch.testing.assert_close(loss2, loss, atol=1e-6, rtol=1e-6)
    assert [int(m["valid"]) for m in metrics2] == [int(m["valid"]) for m in metrics]


def test_nothing_to_learn_gives_zero_loss_and_zero_gradients():
    model = random_draft()
    batch = make_batch([9], seed=9)
    batch.loss_mask[:] = False
    loss, metrics = dflash_loss(model, batch, torch.randn(TINY.vocab_size, TINY.hidden_size), attention="sdpa")
    loss.backward()
    assert loss.item() == 0.0 and all(int(m["valid"]) == 0 for m in metrics)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


# ---- the config ----------------------------------------------------------------------------------

QWEN3_LIKE = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 160,
              "num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "vocab_size": 300, "hidden_act": "silu",
              "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}


def test_config_from_target_copies_the_target():
    cfg = dflash_config_from_target({"text_config": QWEN3_LIKE}, [1, 5, 9], num_hidden_layers=3, block_size=8,
                                    mask_token_id=299)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (64, 160, 8, 2, 16)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.max_position_embeddings == 40960
    assert cfg.target_hidden_size == 64 and cfg.vocab_size == 300 and cfg.target_layer_ids == (1, 5, 9)
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.mask_token_id) == (3, 8, 299)
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg
    yarn = {**QWEN3_LIKE, "rope_parameters": {"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0}}
    scaled = dflash_config_from_target(yarn, [2], 1, 16, 0, overrides={"layer_types": ["sliding_attention"],
                                                                       "sliding_window": 64})
    assert scaled.rope_theta == 5e5 and scaled.rope_scaling == {"rope_type": "yarn", "factor": 4.0}
    assert scaled.layer_types == ("sliding_attention",) and scaled.sliding_window == 64


@pytest.mark.parametrize("layers,mask_id,overrides,match", [
    ([5, 1], 0, {}, "strictly ascending"),
    ([1, 11], 0, {}, "0..10"),  # the last layer's output cannot be captured
    ([1], 300, {}, "mask_token_id 300 is not below vocab_size"),
    ([1], 0, {"layer_types": ["sliding_attention"]}, "sliding_window"),
    ([1], 0, {"hidden_act": "gelu"}, "SiLU"),
])
def test_config_refuses_what_sglang_would_serve_wrongly(layers, mask_id, overrides, match):
    with pytest.raises(ValueError, match=match):
        dflash_config_from_target(QWEN3_LIKE, layers, 1, 16, mask_id, overrides=overrides)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 7), (33, 1000), (130, 4099)])
@pytest.mark.parametrize("compiled", [False, True])
def test_hard_ce_pieces_equal_cross_entropy_and_its_autograd(device, dtype, rows, vocab, compiled):
    """hard_ce_rows and hard_ce_grad (eager, and compiled as a GPU step runs them: inductor on the
    GPU; on a CPU aot_eager, which traces the same graph) against F.cross_entropy in float64 and
    its autograd, the gradient scaled per row by coef. Several row counts in one process: the
    compiled functions meet changing shapes, as the chunks of a step do."""
    from specfoundry.families.dflash.loss import hard_ce_grad, hard_ce_rows

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    z = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    coef = torch.rand(rows, generator=g)
    z64 = z.double().requires_grad_()
    want_ce = F.cross_entropy(z64, labels, reduction="none")
    (want_ce * coef.double()).sum().backward()
    rows_fn, grad_fn = hard_ce_rows, hard_ce_grad
    if compiled:
        backend = "inductor" if device == "cuda" else "aot_eager"
        rows_fn = torch.compile(hard_ce_rows, backend=backend, fullgraph=True, dynamic=True)
        grad_fn = torch.compile(hard_ce_grad, backend=backend, fullgraph=True, dynamic=True)
    zd, ld, cd = z.to(device), labels.to(device), coef.to(device)
    ce, hits, lse = rows_fn(zd, ld)
    grad = grad_fn(zd, ld, lse, cd, dtype)
    assert ce.dtype == torch.float32 and grad.dtype == dtype and grad.shape == z.shape
    # the inputs are exact in fp32 (z is rounded to `dtype` before both sides see it), so ce is off
    # by fp32 rounding of a logsumexp over V terms of size up to ~e^16: ~1e-6 relative; the gradient
    # is then rounded to `dtype` once (bf16: 2^-8 relative, on values at most 1 in size)
    torch.testing.assert_close(ce.double().cpu(), want_ce.detach(), atol=1e-4, rtol=1e-5)
    assert torch.equal(hits.cpu(), z.double().argmax(-1) == labels)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=8e-3)
    torch.testing.assert_close(grad.double().cpu(), z64.grad, **tol)


def test_hard_chunk_is_the_same_compiled_or_not_on_cpu_and_the_chain_it_replaced():
    """On a CPU hard_chunk computes exactly what the in-place fp32 chain before it did (the same
    operations in the same order), so every CPU result, a resumed run's bytes included, is kept."""
    from specfoundry.families.dflash.loss import hard_chunk

    g = torch.Generator().manual_seed(3)
    h, head = torch.randn(21, 16, generator=g), torch.randn(300, 16, generator=g)
    labels, coef = torch.randint(0, 300, (21,), generator=g), torch.rand(21, generator=g)
    ce, hits, grad = hard_chunk(h, head, labels, coef, True, lambda x: x @ head.T)
    z = (h @ head.T).float()  # the chain as it was
    lse = torch.logsumexp(z, dim=-1)
    old_ce = lse - z.gather(1, labels[:, None]).squeeze(1)
    old_hits = z.argmax(-1) == labels
    z.sub_(lse[:, None]).exp_()
    z[torch.arange(21), labels] -= 1.0
    z.mul_(coef[:, None])
    assert torch.equal(ce, old_ce) and torch.equal(hits, old_hits)
    assert torch.equal(grad, (z.to(head.dtype) @ head).to(h.dtype))
    compiled = hard_chunk(h, head, labels, coef, True, lambda x: x @ head.T, compiled=True)  # plain on a CPU
    assert all(torch.equal(a, b) for a, b in zip(compiled, (ce, hits, grad), strict=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 7), (33, 1000), (130, 4099)])
@pytest.mark.parametrize("compiled", [False, True])
def test_teacher_probs_equal_the_softmax_in_float64(device, dtype, rows, vocab, compiled):
    """teacher_probs (eager, and compiled as a GPU step runs it: inductor on the GPU, aot_eager on a
    CPU) against softmax in float64: p rounded once to `dtype`, the argmax the target's top token.
    Several row counts in one process, as a step's chunks meet the compiled function."""
    from specfoundry.families.dflash.loss import teacher_probs

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(rows * 5 + vocab)
    t = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    fn = teacher_probs
    if compiled:
        fn = torch.compile(teacher_probs, backend="inductor" if device == "cuda" else "aot_eager", fullgraph=True,
                           dynamic=True)
    p, ids = fn(t.to(device), dtype)
    want = torch.softmax(t.double(), dim=-1)
    assert p.dtype == dtype and p.shape == t.shape
    # the fp32 softmax is within a few fp32 ulps of float64's (~1e-6 relative); storing p in `dtype`
    # rounds once more (bf16: 2^-8 relative); the atol covers probabilities that underflow fp32
    tol = dict(atol=1e-7, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-7, rtol=2 ** -8)
    torch.testing.assert_close(p.double().cpu(), want, **tol)
    # t is exact in fp32, so the top logit is the top probability; random draws leave no ties
    assert torch.equal(ids.cpu(), t.double().argmax(-1))


def test_soft_chunk_is_the_same_compiled_or_not_on_cpu_and_the_chain_it_replaced():
    """On a CPU the soft teacher's distribution is the chain it was before teacher_probs (the same
    operations in the same order), compiled switch or not: every CPU result is kept."""
    from specfoundry.families.dflash.loss import soft_chunk
    from specfoundry.kernels.soft_ce import soft_target_cross_entropy

    g = torch.Generator().manual_seed(4)
    h, head = torch.randn(21, 16, generator=g), torch.randn(300, 16, generator=g)
    teacher_h = torch.randn(21, 16, generator=g)
    old_p = torch.softmax((teacher_h @ head.T).float(), dim=-1)  # the chain as it was
    z = h @ head.T
    old_loss = soft_target_cross_entropy(z.clone().requires_grad_(), old_p.to(h.dtype), torch.full((21,), 0.5),
                                         normaliser=torch.tensor(10.5), impl="reference")
    old_hits = z.argmax(-1) == old_p.argmax(-1)
    runs = [soft_chunk(h, head, teacher_h, 0.5, torch.tensor(10.5), 1.0, "reference", True, lambda x: x @ head.T,
                       compiled=c) for c in (False, True)]
    for loss, hits, grad in runs:
        assert torch.equal(loss, old_loss.detach() * 10.5 / 0.5) and torch.equal(hits, old_hits)
        assert torch.equal(grad, runs[0][2])


# ---- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("teacher", ["hard", "soft"])
def test_loss_with_flex_matches_sdpa_on_gpu(teacher):
    """The whole loss and its gradients through FlexAttention equal the dense path (fp32), at a
    shape with several 128-blocks, a sliding layer and a short row."""
    cfg = DFlashConfig.from_dict({**TINY.to_dict(), "hidden_size": 128, "intermediate_size": 256,
                                  "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
                                  "block_size": 16, "layer_types": ["full_attention", "sliding_attention"],
                                  "sliding_window": 48, "target_hidden_size": 64})
    model = random_draft(cfg).cuda()
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda")
    batch = make_batch([300, 170], width=300, cfg=cfg, seed=10).to("cuda")
    runs = {}
    for attention in ("sdpa", "flex"):
        runs[attention] = loss_and_grads(model, lambda a=attention: dflash_loss(
            model, batch, head, num_anchors=40, teacher=teacher, attention=a, loss_kernel="triton")[0])
    torch.testing.assert_close(runs["flex"][0], runs["sdpa"][0], atol=1e-4, rtol=1e-4)
    for name, g in runs["sdpa"][1].items():
        # fp32 throughout; flex accumulates in another order (tf32 is off by default)
        torch.testing.assert_close(runs["flex"][1][name], g, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("objective", ["dflash", "dpace"])
def test_loss_at_the_real_shape_holds_no_full_logits(objective):
    """Qwen3-8B's width and vocabulary, one row of 3072 tokens, 512 anchors of 16: the loss and its
    backward never hold an fp32 [N*B, V] logits tensor (5 GB) beyond the step's activations, with
    either objective (D-PACE's weights wait for every chunk, its logits do not)."""
    cfg = DFlashConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=1, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, target_hidden_size=4096,
                       target_layer_ids=(1, 9, 17, 25, 33), block_size=16, mask_token_id=151669,
                       rope_theta=1e6, max_position_embeddings=40960)
    torch.manual_seed(0)
    model = DFlashDraft(cfg).to("cuda", torch.bfloat16)
    head = (torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda") * 0.02).to(torch.bfloat16)
    t = 3072
    g = torch.Generator().manual_seed(0)
    batch = Batch(torch.randint(0, 151000, (1, t), generator=g), torch.ones(1, t, dtype=torch.bool),
                  torch.randn(1, t, 5 * 4096, generator=g), None, [t], [0], 0).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, metrics = dflash_loss(model, batch, head, num_anchors=512, attention="flex", objective=objective)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert math.isfinite(loss.item())
    assert 512 * 15 - 100 < sum(int(m["valid"]) for m in metrics) <= 512 * 15  # a few blocks run off the end
    assert extra < 512 * 16 * cfg.vocab_size * 4, extra / 2**30
