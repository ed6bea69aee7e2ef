"""Bundled example models."""
