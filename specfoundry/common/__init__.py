"""Helpers every stage may use: target loading, conversations, progress, config and file I/O."""
