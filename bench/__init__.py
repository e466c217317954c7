"""Benchmarks: a closed-loop streaming load client (`python -m bench`), baselines to compare
against (`bench/baselines/`), and the side-by-side suite behind `make bench` (`bench.suite`)."""
