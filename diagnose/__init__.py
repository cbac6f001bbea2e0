"""layerscope.diagnose"""
