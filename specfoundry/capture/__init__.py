"""sf-capture: target prefill over conversations, stored as a feature set."""
