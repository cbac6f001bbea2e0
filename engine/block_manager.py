"""Paged KV-cache block manager: reference counts, a free queue, prefix caching.

No torch here: blocks are integers, so every invariant is testable on plain data.

Prefix caching uses chained block hashes: the hash of a full block is a 128-bit
BLAKE2b digest of (parent's hash, this block's token ids). Only blocks whose KV has
been computed are hashed (``cache_blocks`` after each step). A lookup also checks the
stored tokens (the token-equality guard) and the parent hash the block was computed
after, so a colliding hash alone never serves the wrong KV: that would take two
different prefixes with the same 128-bit chained digest.

Freed blocks keep their hash and stay reusable until they are handed out again.
The free queue is LRU: allocation takes from the front, frees append at the back, a
request's blocks in reverse order so its tail is evicted before its shared prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Hashable, Sequence

from layerscope.engine.request import Request


def hash_block(parent_hash: Hashable | None, token_ids: Sequence[int]) -> Hashable:
    """Chained, collision-resistant block hash (bytes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash if isinstance(parent_hash, bytes) else repr(parent_hash).encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


HASH_MEMO_MAX = 1 << 18  # a hash memo stops growing here (~110 MB: a 16-token key and its digest ~430 B)


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: Hashable | None = None
        self.parent_hash: Hashable | None = None  # hash of the prefix this block's KV was computed after
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_memo: dict | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[Hashable, int] = {}
        # (parent hash, tokens) -> hash_block's digest, for a caller that hashes the same prompts again
        # and again (a replay's split replays one workload per coalition); hash_block is pure, so a
        # memo changes only the time. None: hash every block
        self.hash_memo = hash_memo
        # prefix-cache statistics, in tokens (vLLM counts queries and hits in tokens)
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # ---- sizes ----
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request's tokens: (block ids, number of tokens).

        At least one token is always left to compute, so the step yields logits.
        Statistics are counted by ``record_prefix_lookup`` once the request is admitted,
        so a request that waits several steps is counted once.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // bs
        hits: list[int] = []
        parent: Hashable | None = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = self._hash(parent, chunk)
            block_id = self.hash_to_block.get(h)
            if block_id is None or block_id in hits:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.parent_hash != parent:  # collision guards
                break
            hits.append(block_id)
            parent = h
        return hits, len(hits) * bs

    def _hash(self, parent: Hashable | None, chunk: tuple[int, ...]) -> Hashable:
        memo = self.hash_memo
        if memo is None:
            return hash_block(parent, chunk)
        h = memo.get((parent, chunk))
        if h is None:
            h = hash_block(parent, chunk)
            if len(memo) < HASH_MEMO_MAX:
                memo[(parent, chunk)] = h
        return h

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.num_prefix_queries += num_tokens
            self.num_prefix_hits += num_hit_tokens

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Hash the request's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(request.block_ids))
        if num_full <= len(request.block_hashes):  # no block filled this step (most decode steps)
            return
        for i in range(len(request.block_hashes), num_full):
            parent = request.block_hashes[i - 1] if i else None
            chunk = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            h = self._hash(parent, chunk)
            request.block_hashes.append(h)
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is None and h not in self.hash_to_block:
                block.block_hash = h
                block.parent_hash = parent
                block.token_ids = chunk
                self.hash_to_block[h] = block.block_id

    # ---- allocation ----
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        ``new_computed_blocks`` are prefix-cache hits to adopt (first allocation only).
        Returns the newly allocated block ids, or None when the pool cannot fit them
        (nothing is changed then).
        """
        num_hits = len(new_computed_blocks)
        num_new_blocks = max(self.num_blocks_for(request.num_computed_tokens + num_hits * self.block_size
                                                 + num_new_tokens) - len(request.block_ids) - num_hits, 0)
        if not num_hits:  # a running request's step (the replay's hot path): most fill no new block
            if num_new_blocks == 0:
                return []
            if num_new_blocks > len(self.free_block_queue):
                return None
        else:
            # adopting a cached block that no one holds takes it out of the free queue
            num_evictable_hits = sum(1 for b in new_computed_blocks if self.blocks[b].ref_count == 0)
            if num_new_blocks + num_evictable_hits > self.num_free_blocks:
                return None
            for block_id in new_computed_blocks:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_block_queue[block_id]
                block.ref_count += 1
                request.block_ids.append(block_id)
        new_ids = [self._take_free_block() for _ in range(num_new_blocks)]
        request.block_ids.extend(new_ids)
        return new_ids

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash = block.parent_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def free(self, request: Request) -> None:
        """Release every block the request holds (tail first) and forget its table."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed twice (request {request.request_id})")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_queue[block_id] = None
        request.block_ids = []
        request.block_hashes = []

    def reset_prefix_cache(self) -> None:
        """Forget cached content of blocks no one holds."""
        for block_id in self.free_block_queue:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self.hash_to_block.pop(block.block_hash, None)
                block.block_hash = block.parent_hash = None
                block.token_ids = ()

    def check_invariants(self, requests: Sequence[Request] = ()) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (used by tests)."""
        held: dict[int, int] = {}
        for r in requests:
            for b in r.block_ids:
                held[b] = held.get(b, 0) + 1
        for block in self.blocks:
            in_free = block.block_id in self.free_block_queue
            if in_free != (block.ref_count == 0):
                raise AssertionError(f"{block}: in free queue={in_free} but ref_count={block.ref_count}")
            if block.ref_count < 0:
                raise AssertionError(f"{block}: negative ref count")
            if requests and held.get(block.block_id, 0) != block.ref_count:
                raise AssertionError(f"{block}: held by {held.get(block.block_id, 0)} requests")
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        if used + self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"free {self.num_free_blocks} + used {used} != total {self.num_blocks}")
        for h, block_id in self.hash_to_block.items():
            if self.blocks[block_id].block_hash != h:
                raise AssertionError(f"hash map points at {self.blocks[block_id]} for hash {h}")
