"""Sliding-window layers' K/V in window slots lent to the blocks their windows reach."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import EngineConfig, LLMEngine, SamplingParams
from runtime import engine as engine_module
from runtime.kv.block_manager import KVCacheManager
from runtime.kv.window_slots import WindowSlots
from runtime.sequence import Sequence

from .test_correctness import TOL, _check, _prompt, _staggered

BS, W = 4, 8


def _manager(num_blocks=32, num_slots=16):
    window = WindowSlots(num_slots, num_blocks, W, BS)
    return KVCacheManager(num_blocks, BS, True, window), window


def _run(kv, seq, n):
    """Allocate `n` new tokens' room and mark them computed, as a step does."""
    assert kv.allocate_slots(seq, n)
    seq.num_computed_tokens += n


def _held(window):
    return {b for b in range(len(window.slot_of) - 1) if window.covers([b])}


def test_a_sequence_holds_the_slots_its_next_windows_reach():
    kv, window = _manager()
    seq = Sequence("a", 0, list(range(10, 30)), SamplingParams())
    _run(kv, seq, 20)                          # prefill: every query reaches back 7 keys
    assert window.num_used == 5 and _held(window) == set(seq.block_ids)
    seq.token_ids.append(99)
    _run(kv, seq, 1)                           # the query at 20 reaches keys 13..20: blocks 3 to 5
    assert seq.window_from == 3 and window.num_used == 3
    assert _held(window) == set(seq.block_ids)   # given back, the slots keep their K/V
    for _ in range(8):
        seq.token_ids.append(99)
        _run(kv, seq, 1)
    assert window.num_used == 3 and seq.window_from == (seq.num_computed_tokens - 1 - W + 1) // BS
    kv.free(seq)
    assert window.num_used == 0 and kv.pool.num_used == 0


def test_a_prefix_hit_takes_its_windows_slots_and_is_cut_back_where_they_went():
    kv, window = _manager(num_slots=8)
    first = Sequence("a", 0, list(range(10, 34)), SamplingParams())   # 6 full blocks
    _run(kv, first, 24)
    blocks = list(first.block_ids)
    kv.free(first)
    hit = Sequence("b", 0, list(range(10, 34)) + [7, 7], SamplingParams())
    computed = kv.get_computed_blocks(hit)
    assert computed == blocks                  # the window before the hit's end kept its slots
    assert kv.allocate_slots(hit, 2, computed)
    assert hit.window_from == kv.window.first_needed(24) == 4
    assert window.num_used == 3                # blocks 4 and 5, and the new one
    kv.free(hit)
    # Another sequence takes every slot, least recently released first: the hit's
    # window goes, so a hit now stops where a window still has its slots (none here).
    other = Sequence("c", 0, list(range(100, 132)), SamplingParams())
    _run(kv, other, 32)
    assert window.evictions > 0 and not window.covers(blocks[4:6])
    again = Sequence("d", 0, list(range(10, 34)) + [7, 7], SamplingParams())
    assert kv.get_computed_blocks(again) == []
    kv.free(other)
    assert window.num_used == 0 and kv.pool.num_used == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), max_size=40), st.integers(1, 40), st.integers(1, 8))
def test_a_hit_is_cut_back_to_the_longest_end_whose_window_kept_its_slots(slots, window, block_size):
    """`usable_hit` skips back over every end whose window reaches a block without its
    slot, and stops at the longest end whose window has them all."""
    from runtime.kv.window_slots import first_needed_block, usable_hit

    def ok(n):
        return all(slots[i] for i in range(first_needed_block(n * block_size, window, block_size), n))
    assert usable_hit(len(slots), window, block_size, slots.__getitem__) == \
        max((n for n in range(len(slots) + 1) if ok(n)), default=0)


def test_a_router_cuts_a_replicas_match_where_its_engine_cuts_the_hit():
    """A replica reports its cached block hashes and which of their blocks hold window
    slots; from those and a request's own hashes a router cuts the replica's prefix
    match exactly where the engine cuts the hit, also where slots went to others."""
    from types import SimpleNamespace

    from deployments.router import PrefixAwareRouter, leading_matches
    from runtime.kv.prefix_cache import block_hashes
    from runtime.kv.window_slots import usable_hit

    router = PrefixAwareRouter.__new__(PrefixAwareRouter)   # its matching alone, outside a Serve cluster
    router.initialize_state()
    kv, window = _manager(num_blocks=64, num_slots=20)
    rng = random.Random(5)
    families = [list(range(100 * k, 100 * k + 24)) for k in range(4)]   # six blocks each
    hits = cut = 0
    for i in range(60):
        ids = rng.choice(families)[:rng.choice([8, 16, 24])] + [rng.randrange(1000, 2000)
                                                              for _ in range(rng.randrange(1, 9))]
        seq = Sequence(f"s{i}", 0, ids, SamplingParams())
        hashes = block_hashes(ids, BS, None)[:(len(ids) - 1) // BS]   # the engine leaves a token to compute
        cached = list(kv.cache.cached_hashes())
        held, slotted = set(cached), set(kv.window_block_hashes(cached))
        n = leading_matches(hashes, held)
        routed = usable_hit(n, W, BS, lambda j: hashes[j] in slotted)
        report = {"block_hashes": list(held), "window_tokens": W, "window_block_hashes": list(slotted)}
        assert router._match(hashes, SimpleNamespace(replica_id="r", routing_stats=report), BS) == routed
        computed = kv.get_computed_blocks(seq)
        assert routed == len(computed), (i, n, routed, len(computed))
        hits += bool(computed)
        cut += routed < n
        rest = len(ids) - len(computed) * BS
        assert kv.allocate_slots(seq, rest, computed)
        seq.num_computed_tokens += rest
        kv.free(seq)
    assert hits > 20 and cut > 10 and window.evictions > 0
    assert kv.pool.num_used == 0 and window.num_used == 0


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_a_replica_reports_which_cached_blocks_hold_window_slots(model_dirs, name):
    """`record_routing_stats` from an engine process: beside its cached block hashes, for a
    model with sliding layers, the window's length and the hashes whose blocks hold
    their slots (not those whose slots a later prompt took); nothing more for a model
    without."""
    import asyncio
    import time

    from deployments.llm_server import LLMServer

    server = LLMServer({"model": model_dirs[name], "num_gpu_blocks": 64, "block_size": 4, "max_num_seqs": 2,
                        "max_num_batched_tokens": 32, "device": "cpu"}, engine_nice=None)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def run(ids):
        async for _ in server.engine.generate(prompt_token_ids=ids, params=params):
            pass

    try:
        rng = random.Random(7)
        first, second = _prompt(rng, 100), _prompt(rng, 100)
        for ids in (first, second):
            asyncio.run(run(ids))
        deadline = time.monotonic() + 10
        while len(server.engine.cached_block_hashes(1000)) < 48 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.6)   # one more snapshot, taken after both prompts' blocks were cached
        stats = server.record_routing_stats()
        held = stats["block_hashes"]
        assert len(held) >= 48
        if name == "llama":
            assert "window_tokens" not in stats and "window_block_hashes" not in stats
            return
        slotted = stats["window_block_hashes"]
        assert stats["window_tokens"] == 8 and set(slotted) <= set(held)
        assert held[0] in slotted          # the last window the second prompt read keeps its slots
        assert len(slotted) < len(held)    # the first prompt's went to the second
    finally:
        server.engine.shutdown(timeout=5)


def test_short_of_slots_nothing_changes():
    kv, window = _manager(num_slots=4)
    a = Sequence("a", 0, list(range(10, 22)), SamplingParams())
    _run(kv, a, 12)                            # 3 slots of 4
    b = Sequence("b", 0, list(range(50, 58)), SamplingParams())
    free_blocks, used = kv.pool.num_free, window.num_used
    assert not kv.allocate_slots(b, 8)         # 2 slots wanted, 1 free
    assert (b.block_ids, kv.pool.num_free, window.num_used) == ([], free_blocks, used)
    kv.free(a)
    assert kv.allocate_slots(b, 8)


def test_blocks_keep_their_own_slots_when_others_take_new_ones():
    """A block whose idle slot holds its K/V gets that slot back even when a block
    beside it in the same call needs a new one and that slot is the oldest idle."""
    window = WindowSlots(2, 8, W, BS)
    window.acquire([0, 1])
    window.release([0, 1])                     # both idle, block 0's the oldest
    own = int(window.slot_of[0])
    assert window.can_acquire([5, 0], 0)
    window.acquire([5, 0])
    assert window.slot_of[0] == own and window.covers([5]) and not window.covers([1])
    assert window.evictions == 1 and window.num_used == 2


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss"])
def test_a_long_context_holds_its_windows_blocks_only(model_dirs, name):
    """A sliding layer's K/V sit in window slots: a 200-token context holds a few of
    them, however long it is, and the same KV budget gives the main pool the room of
    the full-attention layers alone (more blocks than one pool of every layer)."""
    path = model_dirs[name]
    kw = dict(model=path, kv_cache_memory_bytes=1 << 20, block_size=8, max_num_seqs=8, max_num_batched_tokens=64)
    one, apart = LLMEngine(EngineConfig(**kw, window_pool=False)), LLMEngine(EngineConfig(**kw))
    assert one.kv.window is None and apart.kv.window is not None
    assert apart.num_blocks > 1.3 * one.num_blocks
    assert apart.stats()["kv_cache_bytes_total"] <= 1.01 * kw["kv_cache_memory_bytes"]   # and scratch blocks
    ids = _prompt(random.Random(3), 200)
    apart.add_request("r", None, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                      prompt_token_ids=ids)
    for _ in range(6):   # the prefill's four chunks, then decodes: each gives back what its window left
        apart.step()
    s = apart.stats()
    assert s["window_slots_in_use"] <= 3 and s["num_blocks_held_by_requests"] == 26
    while apart.has_unfinished_requests():
        apart.step()
    assert apart.stats()["window_slots_in_use"] == 0


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss"])
def test_few_window_slots_cut_hits_back_and_match_mlx_lm(model_dirs, name, monkeypatch):
    """With window slots for a handful of windows, prefix hits lose their windows'
    slots to other sequences and are cut back, and sequences wait or are preempted
    for slots: every output is still mlx-lm's."""
    monkeypatch.setattr(engine_module, "num_window_slots", lambda *a: 10)
    path = model_dirs[name]
    rng = random.Random(11)
    shared = _prompt(rng, 40)
    prompts = [shared[:rng.choice([16, 32, 40])] + _prompt(rng, rng.randrange(1, 20)) for _ in range(12)]
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=48, block_size=4, max_num_batched_tokens=16,
                                    max_num_seqs=8))
    assert engine.kv.window.num_slots == 10
    outs = _staggered(engine, prompts, 3, lambda: rng.randrange(1, 4))
    s = engine.stats()
    assert s["window_slot_evictions"] > 0 and s["prefix_cache_hit_tokens"] > 0
    assert s["num_blocks_held_by_requests"] == 0 and s["window_slots_in_use"] == 0
    for i, p in enumerate(prompts):
        _check(engine, outs[f"r{i}"], p, TOL[name])
