"""layerscope.engine.parallel"""
