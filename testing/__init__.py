"""layerscope.testing: what tests and benchmarks build runs from (synthetic run bundles, synth.py).
Nothing in the product imports it."""
