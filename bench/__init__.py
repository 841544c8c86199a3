"""Benchmarks: `python -m bench.<name>`; results in bench/results and BENCHMARKS.md."""
