"""Benchmark workloads (flax, synthetic data, shapes configurable)."""
