"""sf-eval: acceptance length by real speculative decoding against the target, and the gate."""
