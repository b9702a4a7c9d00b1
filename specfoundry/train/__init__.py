"""sf-train: the EAGLE-3 draft, Training-Time Test, the Accelerate loop, checkpoints, export."""
