"""Benchmark scripts, run as ``python benchmarks/NAME.py`` (the tests import them as ``benchmarks.NAME``)."""
