"""Benchmarks: workloads, a runner that measures the engine, and reports with hardware bounds."""
