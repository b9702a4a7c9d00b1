"""The DFlash family: a block-parallel draft on the target's frozen embedding and lm_head."""
