"""Benchmarks: each measures its baseline in the same run and prints ratios, never absolute timings alone."""
