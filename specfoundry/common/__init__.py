"""Helpers every stage may use: target loading, progress, config and file I/O."""
