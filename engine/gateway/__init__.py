"""layerscope.engine.gateway: OpenAI-compatible HTTP server, admission control, router."""
