"""DFlash2: DFlash's backbone with grouped dynamic convolutions around its sublayers and a low-rank
selector over each slot's top candidates (docs/families.md, "DFlash2")."""
