"""Kernels, each with a plain torch reference.

- tree_attention: the Training-Time Test attention mask as a FlexAttention BlockMask.
- dflash_attention: DFlash's block attention over the context before each anchor.
- soft_ce: masked soft-target cross entropy whose backward writes into the logits buffer.
- lk_loss: the LK losses on the acceptance rate (tv, lk-alpha, lk-lambda), in place the same way.
- fused_moe: a mixture-of-experts layer's routed experts in two fused grouped GEMMs (the target's
  side: transformers' experts interface, common/experts.py).
All import on a CPU-only machine (Triton kernels run there under TRITON_INTERPRET=1, tests only);
none imports a stage.
"""
