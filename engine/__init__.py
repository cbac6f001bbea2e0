"""layerscope.engine"""
