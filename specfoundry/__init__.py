"""specfoundry: train speculative-decoding draft models (EAGLE-3 and 3.1, DFlash, Domino, DSpark,
DFlash2, P-EAGLE: families/) for a target LLM."""

__version__ = "0.1.0"
