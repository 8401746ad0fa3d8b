"""Benchmarks: ratios measured in one run (ours vs peers vs the machine's limit)."""
