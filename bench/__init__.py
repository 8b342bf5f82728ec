"""Benchmarks (not tests): `python -m bench.<name>`."""
