"""layerscope.dashboards"""
