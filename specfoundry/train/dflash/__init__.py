"""The DFlash family: its block-parallel draft model, anchored-block training loss and config."""
