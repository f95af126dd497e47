"""Shared, sharding-agnostic model and data pieces used by the example scripts."""
