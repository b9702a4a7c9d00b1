"""The DFlash family: a block-parallel draft on the target's frozen embedding and lm_head (config,
model, loss, export, options and the family, families/interface.py's interface)."""
