"""BlockManager: property-based (stateful) tests plus focused unit tests.

Everything is plain integers (no torch). The tests keep their own model of the KV cache:
every slot a step "computes" records the full token prefix that produced it, so a
prefix-cache hit is sound iff each slot of each hit block holds exactly the request's
own prefix at that position.

(Over 400 lines: the state machine and its invariants are one class; the unit tests
beside it share its helpers.)
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

import layerscope.engine.block_manager as bm_mod
from layerscope.engine.block_manager import BlockManager
from layerscope.engine.request import Request
from layerscope.engine.sampling_params import SamplingParams

SP = SamplingParams(max_tokens=8)


def make_req(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SP, eos_token_id=None, arrival_ns=0)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVModel:
    """What each physical slot holds: the token prefix (inclusive) whose KV was written there."""

    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.slots: list[list[tuple[int, ...] | None]] = [[None] * block_size for _ in range(num_blocks)]

    def write(self, bm: BlockManager, req: Request, start: int, n: int) -> None:
        for pos in range(start, start + n):
            block_id = req.block_ids[pos // self.bs]
            # a step only writes into blocks this request holds alone (no shared-block writes)
            assert bm.blocks[block_id].ref_count == 1, (block_id, bm.blocks[block_id], req)
            self.slots[block_id][pos % self.bs] = tuple(req.all_token_ids[: pos + 1])

    def check_hits(self, req: Request, hits: list[int], num_cached: int) -> None:
        bs = self.bs
        assert num_cached == len(hits) * bs
        assert num_cached < req.num_tokens, "at least one token must be left to compute"
        assert len(set(hits)) == len(hits), f"a block adopted twice: {hits}"
        for i, block_id in enumerate(hits):
            for s in range(bs):
                pos = i * bs + s
                want = tuple(req.all_token_ids[: pos + 1])
                got = self.slots[block_id][s]
                assert got == want, (
                    f"unsound prefix-cache hit: block {block_id} (position {i}) slot {s} holds KV of "
                    f"{got}, request needs {want}"
                )


def snapshot(bm: BlockManager, reqs) -> tuple:
    return (
        list(bm.free_block_queue),
        dict(bm.hash_to_block),
        [(b.ref_count, b.block_hash, b.token_ids) for b in bm.blocks],
        [(r.request_id, list(r.block_ids), list(r.block_hashes), r.num_computed_tokens) for r in reqs],
    )


# ---------------------------------------------------------------------------------------
# stateful machine
# ---------------------------------------------------------------------------------------

TOKENS = st.integers(0, 3)


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives allocate / compute / cache / free / reset directly on a small pool."""

    live = Bundle("live")

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(2, 12),
        prefixes=st.lists(st.lists(TOKENS, min_size=1, max_size=10), min_size=1, max_size=3),
        caching=st.booleans(),
    )
    def setup(self, block_size, num_blocks, prefixes, caching):
        self.bs = block_size
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.kv = KVModel(num_blocks, block_size)
        self.prefixes = prefixes
        self.live_reqs: dict[str, Request] = {}
        self.freed: list[Request] = []
        self.n = 0
        self.total_hits = 0

    # ---- helpers ----
    def _expected_none(self, req: Request, num_new: int, hits: list[int]) -> bool:
        bs = self.bs
        computed = req.num_computed_tokens + len(hits) * bs
        required = ceil_div(computed + num_new, bs)
        new_blocks = max(required - len(req.block_ids) - len(hits), 0)
        evictable = len({b for b in hits if self.bm.blocks[b].ref_count == 0})
        return new_blocks + evictable > self.bm.num_free_blocks

    def _allocate_and_compute(self, req: Request, num_new: int, hits: list[int], num_cached: int) -> bool:
        bm = self.bm
        before = snapshot(bm, [req])
        expect_none = self._expected_none(req, num_new, hits)
        free_front = [b for b in bm.free_block_queue if b not in set(hits)]
        start = req.num_computed_tokens + num_cached
        new_ids = bm.allocate_slots(req, num_new, hits)
        if new_ids is None:
            assert expect_none, "allocate_slots refused although the pool could fit"
            assert snapshot(bm, [req]) == before, "allocate_slots returned None but changed state"
            event("allocate_slots refused")
            return False
        assert not expect_none, "allocate_slots succeeded although the pool could not fit"
        # LRU: new blocks come from the front of the free queue, in order
        assert new_ids == free_front[: len(new_ids)]
        for b in new_ids:
            assert bm.blocks[b].block_hash is None and bm.blocks[b].ref_count == 1
        assert len(req.block_ids) == ceil_div(start + num_new, self.bs)
        # the model writes this chunk's KV, then the step is committed
        req.num_computed_tokens = start
        self.kv.write(bm, req, start, num_new)
        req.num_computed_tokens += num_new
        bm.cache_blocks(req, req.num_computed_tokens)
        self._check_cached(req)
        return True

    def _check_cached(self, req: Request) -> None:
        """Every block in the hash map holds the KV its stored tokens claim."""
        if not self.bm.enable_prefix_caching:
            assert not self.bm.hash_to_block
            return
        for h, block_id in self.bm.hash_to_block.items():
            block = self.bm.blocks[block_id]
            assert len(block.token_ids) == self.bs
            for s, tok in enumerate(block.token_ids):
                written = self.kv.slots[block_id][s]
                assert written is not None and written[-1] == tok

    # ---- rules ----
    @rule(
        target=live,
        which=st.integers(0, 2),
        suffix=st.lists(TOKENS, min_size=0, max_size=8),
        frac=st.floats(0, 1),
    )
    def admit(self, which, suffix, frac):
        prompt = list(self.prefixes[which % len(self.prefixes)]) + suffix
        rid = f"r{self.n}"
        self.n += 1
        req = make_req(rid, prompt)
        hits, num_cached = self.bm.get_computed_blocks(req)
        self.kv.check_hits(req, hits, num_cached)
        if not self.bm.enable_prefix_caching:
            assert hits == [] and num_cached == 0
        if hits:
            self.total_hits += len(hits)
            event("prefix-cache hit")
        remaining = req.num_tokens - num_cached
        num_new = max(1, min(remaining, round(frac * remaining)))
        if not self._allocate_and_compute(req, num_new, hits, num_cached):
            return multiple()
        self.live_reqs[rid] = req
        return req

    @rule(req=live, k=st.integers(1, 6), tok=TOKENS)
    def extend(self, req, k, tok):
        if req.request_id not in self.live_reqs:
            return
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(tok)  # "sampled" after the last chunk
        k = min(k, req.num_tokens - req.num_computed_tokens)
        if not self._allocate_and_compute(req, k, [], 0):
            event("extend refused")

    @rule(req=consumes(live))
    def free(self, req):
        if req.request_id not in self.live_reqs:
            return
        bm = self.bm
        table = list(req.block_ids)
        queue_before = list(bm.free_block_queue)
        released = [b for b in reversed(table) if bm.blocks[b].ref_count == 1]
        bm.free(req)
        assert req.block_ids == [] and req.block_hashes == []
        # tail first at the back of the LRU queue
        assert list(bm.free_block_queue) == queue_before + released
        del self.live_reqs[req.request_id]
        self.freed.append(req)

    @precondition(lambda self: hasattr(self, "bm"))
    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()
        for block_id in self.bm.free_block_queue:
            assert self.bm.blocks[block_id].block_hash is None
        for block_id in self.bm.hash_to_block.values():
            assert self.bm.blocks[block_id].ref_count > 0

    @invariant()
    def pool_consistent(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        live = list(self.live_reqs.values())
        bm.check_invariants(live)
        for r in live:
            assert len(r.block_ids) == ceil_div(r.num_computed_tokens, self.bs)
        for r in self.freed:
            assert r.block_ids == []
        if not live:
            assert bm.num_free_blocks == bm.num_blocks
            assert all(b.ref_count == 0 for b in bm.blocks)
        assert 0.0 <= bm.usage <= 1.0

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for r in list(self.live_reqs.values()):
            self.bm.free(r)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# ---------------------------------------------------------------------------------------
# unit tests
# ---------------------------------------------------------------------------------------


def compute_all(bm: BlockManager, req: Request) -> None:
    """Admit a request and 'compute' its whole prompt in one go (hits adopted)."""
    hits, n = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, req.num_tokens - n, hits) is not None
    req.num_computed_tokens = req.num_tokens
    bm.cache_blocks(req, req.num_computed_tokens)


def test_identical_prompt_hits_all_full_blocks_but_last_token():
    bm = BlockManager(16, 4)
    prompt = list(range(4)) * 3  # 12 tokens: 3 full blocks
    a = make_req("a", prompt)
    compute_all(bm, a)
    b = make_req("b", prompt)
    hits, n = bm.get_computed_blocks(b)
    # the last full block is not a hit: one token must be left to compute
    assert hits == a.block_ids[:2] and n == 8
    c = make_req("c", prompt + [1])
    hits, n = bm.get_computed_blocks(c)
    assert hits == a.block_ids[:3] and n == 12


def test_prompt_differing_in_block_2_hits_exactly_blocks_0_1():
    bm = BlockManager(16, 4)
    prompt = [0, 1, 2, 3, 3, 2, 1, 0, 1, 1, 1, 1, 2]
    a = make_req("a", prompt)
    compute_all(bm, a)
    other = list(prompt)
    other[9] = 0  # block 2 differs
    b = make_req("b", other)
    hits, n = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:2] and n == 8
    # differing in block 0 hits nothing, even though later blocks are equal
    other0 = list(prompt)
    other0[0] = 3
    assert bm.get_computed_blocks(make_req("c", other0)) == ([], 0)


def test_hits_survive_free_and_are_adopted_back_from_free_queue():
    bm = BlockManager(6, 2)
    prompt = [1, 2, 3, 0, 1]
    a = make_req("a", prompt)
    compute_all(bm, a)
    table = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks == 6
    b = make_req("b", prompt)
    hits, n = bm.get_computed_blocks(b)
    assert hits == table[:2] and n == 4
    assert bm.allocate_slots(b, 1, hits) is not None
    assert b.block_ids[:2] == table[:2]
    bm.check_invariants([b])
    assert all(bm.blocks[x].ref_count == 1 for x in b.block_ids)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = make_req("a", [1, 2, 3, 4, 5])
    compute_all(bm, a)
    assert bm.hash_to_block == {}
    assert bm.get_computed_blocks(make_req("b", [1, 2, 3, 4, 5])) == ([], 0)


def test_shared_blocks_refcounted_and_freed_once_each():
    bm = BlockManager(8, 2)
    a = make_req("a", [1, 1, 2, 2, 3])
    compute_all(bm, a)
    b = make_req("b", [1, 1, 2, 2, 0])
    compute_all(bm, b)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert [bm.blocks[x].ref_count for x in a.block_ids[:2]] == [2, 2]
    bm.check_invariants([a, b])
    bm.free(a)
    bm.check_invariants([b])
    assert [bm.blocks[x].ref_count for x in b.block_ids[:2]] == [1, 1]
    bm.free(b)
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_double_free_detected():
    bm = BlockManager(4, 2)
    a = make_req("a", [1, 2, 3])
    compute_all(bm, a)
    clone = make_req("clone", [1, 2, 3])
    clone.block_ids = list(a.block_ids)  # a bookkeeping error: two owners of one ref
    bm.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(clone)


def test_check_invariants_catches_wrong_holder_count():
    bm = BlockManager(4, 2)
    a = make_req("a", [1, 2, 3])
    compute_all(bm, a)
    with pytest.raises(AssertionError):
        bm.check_invariants([a, a])  # two holders claimed, ref count is 1


def test_hash_collision_different_prompt_gets_zero_hits(monkeypatch):
    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, tokens: 12345)
    bm = BlockManager(8, 4)
    a = make_req("a", [0, 1, 2, 3, 0, 1, 2, 3, 1])
    compute_all(bm, a)
    assert len(bm.hash_to_block) == 1  # every block collides: only the first is registered
    b = make_req("b", [3, 2, 1, 0, 0, 1, 2, 3, 1])
    assert bm.get_computed_blocks(b) == ([], 0)
    # same first block: the (genuine) hit on block 0 is still served
    c = make_req("c", [0, 1, 2, 3, 3, 3, 3, 3, 1])
    assert bm.get_computed_blocks(c) == ([a.block_ids[0]], 4)


def _compute_with_kv(bm: BlockManager, kv: KVModel, req: Request) -> None:
    hits, n = bm.get_computed_blocks(req)
    kv.check_hits(req, hits, n)
    assert bm.allocate_slots(req, req.num_tokens - n, hits) is not None
    kv.write(bm, req, n, req.num_tokens - n)
    req.num_computed_tokens = req.num_tokens
    bm.cache_blocks(req, req.num_computed_tokens)


@pytest.mark.parametrize(
    "colliding_hash, computed, victim",
    [
        # every hash collides: block 0 (KV of positions 0-3) is served again for 4-7
        (lambda parent, tokens: 12345, [[3, 3, 3, 3, 1, 2, 0, 1, 2]], [3, 3, 3, 3, 3, 3, 3, 3, 0]),
        # hash(h(6666), 1111) collides with hash(h(5555), 1111): block 1 of the first
        # prompt (computed after 5555) is served after 6666
        (
            lambda parent, tokens: hash(tuple(tokens)),
            [[5, 5, 5, 5, 1, 1, 1, 1, 0], [6, 6, 6, 6, 0]],
            [6, 6, 6, 6, 1, 1, 1, 1, 2],
        ),
    ],
    ids=["constant-hash", "parent-collision"],
)
def test_hash_collision_guard_checks_prefix_not_just_block_tokens(monkeypatch, colliding_hash, computed, victim):
    """BUG: the token-equality guard compares only the block's own tokens.

    With chained hashes, block i's KV depends on the whole prefix, not only on its own
    tokens. Under a hash collision at i > 0, a cached block whose tokens equal the
    request's chunk but whose KV was computed after another prefix (or at another
    position) is served as a hit, contrary to the module's promise that "a hash
    collision can never serve the wrong KV".
    """
    monkeypatch.setattr(bm_mod, "hash_block", colliding_hash)
    bm = BlockManager(16, 4)
    kv = KVModel(16, 4)
    for i, prompt in enumerate(computed):
        r = make_req(f"c{i}", prompt)
        _compute_with_kv(bm, kv, r)
        bm.free(r)
    b = make_req("victim", victim)
    hits, n = bm.get_computed_blocks(b)
    kv.check_hits(b, hits, n)  # fails: a hit block holds KV computed under another prefix


def test_lru_evicts_freed_tail_before_prefix():
    bs = 2
    bm = BlockManager(3, bs)
    a = make_req("a", [1, 2, 3, 0, 2, 2])  # 3 full blocks, all of the pool
    compute_all(bm, a)
    p0, p1, p2 = a.block_ids
    bm.free(a)
    assert list(bm.free_block_queue) == [p2, p1, p0]  # tail first
    # an unrelated request needs one block: it evicts the tail block
    x = make_req("x", [0, 0])
    compute_all(bm, x)
    assert x.block_ids == [p2]
    assert bm.blocks[p0].block_hash is not None and bm.blocks[p1].block_hash is not None
    bm.free(x)
    # the prefix blocks are still served
    b = make_req("b", [1, 2, 3, 0, 2, 2])
    hits, n = bm.get_computed_blocks(b)
    assert hits == [p0, p1] and n == 4
    # with one more unrelated block taken, block p1 is evicted next (then p0)
    y = make_req("y", [3, 3, 3, 3])
    hits_y, _ = bm.get_computed_blocks(y)
    assert hits_y == []
    assert bm.allocate_slots(y, 4) is not None
    # queue order was [p1, p0, p2(x, freed last)]: y takes p1 and p0 (LRU front)
    assert y.block_ids == [p1, p0]
    assert bm.get_computed_blocks(make_req("c", [1, 2, 3, 0, 2])) == ([], 0)


def test_lru_prefers_never_used_blocks_over_cached_ones():
    bm = BlockManager(6, 2)
    a = make_req("a", [1, 2, 3, 0, 2])
    compute_all(bm, a)  # takes blocks 0, 1, 2
    bm.free(a)
    assert list(bm.free_block_queue) == [3, 4, 5, 2, 1, 0]
    x = make_req("x", [0, 0, 0, 0, 0, 0])
    assert bm.allocate_slots(x, 6) == [3, 4, 5]
    hits, _ = bm.get_computed_blocks(make_req("b", [1, 2, 3, 0, 2]))
    assert hits == [0, 1]


def test_allocate_slots_none_changes_nothing():
    bm = BlockManager(4, 2)
    a = make_req("a", [1, 2, 3, 0, 1])
    compute_all(bm, a)  # 3 blocks held, 1 free
    b = make_req("b", [1, 2, 0, 0, 0, 0])
    hits, n = bm.get_computed_blocks(b)
    assert hits == [a.block_ids[0]] and n == 2
    before = snapshot(bm, [a, b])
    # needs 2 new blocks on top of the hit, only 1 free
    assert bm.allocate_slots(b, 4, hits) is None
    assert snapshot(bm, [a, b]) == before
    # an evictable hit counts against the free pool too
    bm.free(a)
    c = make_req("c", [9, 9])
    assert bm.allocate_slots(c, 2) is not None  # 3 free left, hit blocks among them
    d = make_req("d", [1, 2, 3, 0, 1, 1, 1, 1])
    hits, n = bm.get_computed_blocks(d)
    assert n == 4
    before = snapshot(bm, [c, d])
    assert bm.allocate_slots(d, 4, hits) is None  # 2 evictable hits + 2 new > 3 free
    assert snapshot(bm, [c, d]) == before
    assert bm.allocate_slots(d, 2, hits) is not None  # 2 hits + 1 new == 3 free
    bm.check_invariants([c, d])
    assert bm.num_free_blocks == 0


def test_reset_prefix_cache_forgets_only_free_blocks():
    bm = BlockManager(8, 2)
    a = make_req("a", [1, 2, 3, 0, 1])
    compute_all(bm, a)
    b = make_req("b", [3, 3, 1, 1, 1])
    compute_all(bm, b)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.get_computed_blocks(make_req("a2", [1, 2, 3, 0, 1])) == ([], 0)
    hits, n = bm.get_computed_blocks(make_req("b2", [3, 3, 1, 1, 1]))
    assert hits == b.block_ids[:2] and n == 4
    bm.check_invariants([b])


def test_prefix_stats_count_tokens_once_per_admission():
    bm = BlockManager(8, 2)
    a = make_req("a", [1, 2, 3, 0, 1])
    compute_all(bm, a)
    q0, h0 = bm.num_prefix_queries, bm.num_prefix_hits
    hits, n = bm.get_computed_blocks(make_req("b", [1, 2, 3, 0, 2]))
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (q0, h0)  # a lookup alone counts nothing
    bm.record_prefix_lookup(5, n)
    assert bm.num_prefix_queries - q0 == 5
    assert bm.num_prefix_hits - h0 == 4


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 3, 4]),
    base=st.lists(TOKENS, min_size=1, max_size=16),
    cut=st.integers(0, 16),
    tail=st.lists(TOKENS, min_size=1, max_size=6),
)
def test_hit_length_is_longest_common_full_block_prefix(block_size, base, cut, tail):
    """No eviction pressure: a lookup returns exactly the common full-block prefix."""
    bm = BlockManager(64, block_size)
    a = make_req("a", base)
    compute_all(bm, a)
    prompt = base[:cut] + tail
    b = make_req("b", prompt)
    hits, n = bm.get_computed_blocks(b)
    common = 0
    while common < min(len(base), len(prompt)) and base[common] == prompt[common]:
        common += 1
    # blocks of `a` hashed: full blocks of its computed tokens
    expected_blocks = min(common // block_size, len(base) // block_size, (len(prompt) - 1) // block_size)
    assert n == expected_blocks * block_size
    assert hits == a.block_ids[:expected_blocks]


def test_block_manager_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
