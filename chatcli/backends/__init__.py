"""Inference backends: what evaluates tokens and holds KV cells."""
