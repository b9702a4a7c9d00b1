"""The P-EAGLE family: EAGLE-3's features, every draft depth in one forward, COD-sampled training."""
