"""The tensor-parallel context handed explicitly to every parallel layer (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from layerscope.engine.parallel.comm import Communicator


@dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    comm: "Communicator | None" = None  # None when world_size == 1

    def shard(self, size: int, what: str) -> int:
        """Size of this rank's shard of a dimension that must divide evenly."""
        if size % self.world_size:
            raise ValueError(f"{what}={size} is not divisible by tp_size={self.world_size}")
        return size // self.world_size

    def all_reduce(self, x, name: str = ""):
        """Sum over ranks; ``name`` is the layer row issuing it (for the collective records)."""
        return x if self.comm is None else self.comm.all_reduce(x, name)

    def all_gather(self, x, dim: int = -1, name: str = ""):
        return x if self.comm is None else self.comm.all_gather(x, dim, name)
