"""layerscope.diagnose.tui"""
