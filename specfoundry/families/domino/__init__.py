"""The Domino draft family: DFlash plus a GRU prefix head with a residual logit correction."""
