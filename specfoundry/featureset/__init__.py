"""The feature set: the versioned on-disk contract between sf-capture and sf-train.

See docs/featureset.md for the format. `store` holds the writer and the reader (one module, so
the two can never disagree); `manifest` holds the manifest and its checks.
"""
