"""sf-eval run: acceptance length by real speculative decoding against the target, through the
decoding core (decoding/) and each family's decoder; the report, table, JSON and plot. The gate
(sf-eval gate) is gate.py, above every stage."""
