"""Replica choice (layer ``gateway.route``).

Policies (``router_policy``):

- ``round_robin``: replicas in turn.
- ``least_loaded``: the replica with the fewest requests in flight from this gateway
  (ties: the lowest index after the last pick, so equal loads still rotate).
- ``prefix_affinity``: sticky by a hash of the prompt's first ``block_size`` tokens,
  so prompts sharing their first KV block (a system prompt, a session's history) meet
  the prefix cache that holds it; prompts shorter than one block have no cacheable
  prefix and go least-loaded.

The ``router.skew`` fault wraps the router (``faults.py``) to send that share of
requests to replica 0 whatever the policy says.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

POLICIES = ("round_robin", "least_loaded", "prefix_affinity")


def prefix_hash(token_ids: Sequence[int], block_size: int) -> int | None:
    """A stable hash (same in every process and run) of the first full block, or None."""
    if len(token_ids) < block_size:
        return None
    data = b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids[:block_size])
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class Router:
    def __init__(self, policy: str, num_replicas: int, block_size: int):
        if policy not in POLICIES:
            raise ValueError(f"router_policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.policy = policy
        self.num_replicas = num_replicas
        self.block_size = block_size
        self._next = 0
        self.num_routed = [0] * num_replicas

    def choose(self, token_ids: Sequence[int], num_in_flight: Sequence[int], alive: Sequence[bool] | None = None) -> int:
        """The replica for a prompt, given each replica's requests in flight; counts the pick."""
        alive = alive or [True] * self.num_replicas
        if self.policy == "round_robin":
            idx = self._round_robin(alive)
        elif self.policy == "least_loaded":
            idx = self._least_loaded(num_in_flight, alive)
        else:
            h = prefix_hash(token_ids, self.block_size)
            if h is None:
                idx = self._least_loaded(num_in_flight, alive)
            else:
                idx = h % self.num_replicas
                if not alive[idx]:  # its replica is gone: the next live one keeps it sticky
                    idx = next(i % self.num_replicas for i in range(idx, idx + self.num_replicas)
                               if alive[i % self.num_replicas])
        self.num_routed[idx] += 1
        return idx

    def _round_robin(self, alive: Sequence[bool]) -> int:
        for _ in range(self.num_replicas):
            idx = self._next
            self._next = (self._next + 1) % self.num_replicas
            if alive[idx]:
                return idx
        raise RuntimeError("no replica is alive")

    def _least_loaded(self, num_in_flight: Sequence[int], alive: Sequence[bool]) -> int:
        order = [(self._next + i) % self.num_replicas for i in range(self.num_replicas)]
        live = [i for i in order if alive[i]]
        if not live:
            raise RuntimeError("no replica is alive")
        idx = min(live, key=lambda i: num_in_flight[i])
        self._next = (idx + 1) % self.num_replicas
        return idx
