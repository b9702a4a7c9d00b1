"""specfoundry: train speculative-decoding draft models (EAGLE-3) for a target LLM."""

__version__ = "0.1.0"
