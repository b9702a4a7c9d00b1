"""The family-neutral decoding core: the target over a KV cache (target.py), sampling
(sampler.py), the acceptance rules (accept.py), draft-then-verify rounds of one sequence and the
target alone (rounds.py), and token trees (tree.py). Each family's decoder (families/<name>/)
drafts; this package verifies, accepts and keeps the time. It imports no family."""
