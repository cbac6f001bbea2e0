"""layerscope.testing: what tests and benchmarks build runs from (synthetic run bundles, synth.py;
live servers started and stopped, servers.py).
Nothing in the product imports it."""
