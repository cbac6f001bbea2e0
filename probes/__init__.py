"""layerscope.probes"""
