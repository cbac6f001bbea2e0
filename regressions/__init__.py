"""layerscope.regressions"""
