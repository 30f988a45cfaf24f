"""Benchmarks behind `jaxseek bench NAME`: each module prints one JSON line of measured figures."""
