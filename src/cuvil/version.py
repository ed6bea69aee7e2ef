"""The package version: one place, read by setup.cfg, the artifacts' manifests and the cache keys."""
__version__ = "0.1.0"
