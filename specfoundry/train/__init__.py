"""sf-train and sf-export: the Trainer (Accelerate, ZeRO-2), its checkpoints and metrics, the feature
loader, and the export command. The drafts themselves, of every family, live in families/."""
