"""layerscope.regressions.load: the ``client`` layer — workloads and the load generator.

Imports nothing of the engine or the gateway (tests/regressions/test_run_api.py checks),
and the gateway never imports it: a workload drives any OpenAI-compatible server.
"""
