"""sf-train: the EAGLE-3 draft, Training-Time Test, the Trainer (Accelerate), checkpoints, export."""
