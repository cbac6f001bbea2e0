"""layerscope.replay: replay a run through the engine's own Scheduler and BlockManager on a
virtual clock, split a change between two runs by cause (Shapley over components), and
answer "what if" (docs/replay.md). Torch-free. Nothing is imported at package import time."""
