"""sf-regen's generation backends.

- registry.py: the backends by name, what --backend picks, loaded with its target;
- interface.py: the interface every backend implements and imports (Request, Generation, serve),
  and the sampling settings; it imports no backend (registry.py imports each on first use);
- hf.py: transformers in this process, by model.generate or the slot engine (slots.py, with its
  token sampling in sampling.py);
- openai.py: OpenAI-compatible servers, over a fleet that survives servers dying (fleet.py);
- sglang.py: the offline sglang.Engine.
"""
