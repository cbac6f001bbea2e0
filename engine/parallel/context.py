"""The tensor-parallel context handed explicitly to every parallel layer (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class Collectives(Protocol):
    """What a parallel layer needs of a rank's communicator (``comm.Communicator``)."""

    def all_reduce(self, x: Any, name: str = "") -> Any: ...

    def all_gather(self, x: Any, dim: int = -1, name: str = "") -> Any: ...


@dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    comm: Collectives | None = None  # None when world_size == 1

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
