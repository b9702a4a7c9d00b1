"""Kernels of the draft's training step, each with a plain torch reference.

- tree_attention: the Training-Time Test attention mask as a FlexAttention BlockMask.
- soft_ce: masked soft-target cross entropy whose backward writes into the logits buffer.
Both import on a CPU-only machine; neither imports any stage.
"""
