"""Benchmarks, run from a checkout (`python -m benchmarks.X`); not part of the engine package."""
