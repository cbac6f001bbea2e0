"""Diagnose engines we do not build (vLLM, SGLang) from what they expose: Prometheus
``/metrics`` texts, their startup/periodic logs, and benchmark results (docs/external.md).

Torch-free and engine-free: ``exposition`` parses metric texts, ``names`` maps each
engine's metric names (by version) onto DESIGN.md's layers, ``server_log`` reads engine
logs, ``analysis`` builds the single-run report and the two-run comparison of an
external bundle. Nothing is imported at package import time.
"""
