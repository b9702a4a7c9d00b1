"""The DSpark draft family: DFlash plus a low-rank Markov head and a confidence head."""
