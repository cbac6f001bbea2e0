"""layerscope.engine.models"""
