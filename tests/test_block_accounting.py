"""Property test: any interleaving of add / step / abort / finish / recover keeps exact
block accounting, of the main pool's blocks and of the window slots lent to them, and
ends with every block free or held only by the prefix cache."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import EngineConfig, LLMEngine, SamplingParams
from runtime import engine as engine_module


@pytest.fixture(scope="module")
def engine(model_dirs):
    return LLMEngine(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=12, block_size=4,
                                  max_num_batched_tokens=16, max_num_seqs=6))


@pytest.fixture(scope="module")
def window_engine(model_dirs):
    """Gemma 3's shape (window 8) with window slots for about two sequences' windows, so
    that hits lose theirs and sequences wait or are preempted for slots."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "num_window_slots", lambda *a: 7)
        e = LLMEngine(EngineConfig(model=model_dirs["gemma3"], num_gpu_blocks=16, block_size=4,
                                   max_num_batched_tokens=16, max_num_seqs=6))
    assert e.kv.window.num_slots == 7
    return e


def assert_exact_refcounts(engine):
    live = [s for r in engine.requests.values() for s in r.seqs if not s.is_finished]
    held = Counter(b for s in live for b in s.block_ids)
    pool = engine.kv.pool
    for b in range(pool.num_blocks):
        assert pool.ref_cnt[b] == held.get(b, 0), f"block {b}: ref {pool.ref_cnt[b]} != {held.get(b, 0)}"
        assert pool.is_free(b) == (held.get(b, 0) == 0)
    for h in engine.kv.cache.cached_hashes():
        assert pool.block_hash[engine.kv.cache._blocks[h]] == h
    for s in live:
        assert len(s.block_ids) == len(set(s.block_ids))
    assert pool.num_refs == sum(held.values())
    assert pool.num_shared_refs == sum(held.values()) - len(held)
    assert pool.peak_used >= len(held)
    if engine.kv.window is not None:
        assert_exact_window_refcounts(engine.kv.window, live)


def assert_exact_window_refcounts(w, live):
    """A live sequence references the slots of `block_ids[window_from:]`, every one of
    them attached, from no later than its next query's window starts."""
    held = Counter(int(w.slot_of[b]) for s in live for b in s.block_ids[s.window_from:])
    assert w.scratch not in held, "a block in a live window has no slot"
    for slot in range(w.num_slots):
        assert w.ref_cnt[slot] == held.get(slot, 0), f"slot {slot}: ref {w.ref_cnt[slot]} != {held.get(slot, 0)}"
        assert (slot in w._free) == (held.get(slot, 0) == 0)
        if w.block_of[slot] >= 0:
            assert w.slot_of[w.block_of[slot]] == slot
    for b, slot in enumerate(w.slot_of):
        if slot != w.scratch:
            assert w.block_of[slot] == b
    for s in live:
        if s.block_ids:
            assert s.window_from <= w.first_needed(s.num_computed_tokens)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(3, 6), min_size=1, max_size=30),
                  st.integers(1, 12), st.integers(1, 2), st.sampled_from([None, "a", "b"])),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("recover")),
    ),
    min_size=1, max_size=40,
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_random_interleavings_keep_exact_accounting(engine, ops):
    _interleave(engine, ops)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_random_interleavings_keep_exact_window_slot_accounting(window_engine, ops):
    _interleave(window_engine, ops)
    w = window_engine.kv.window
    assert all(c == 0 for c in w.ref_cnt) and w.num_free == w.num_slots


def _interleave(engine, ops):
    ids = []
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, n, salt = op
            rid = f"q{len(ids)}-{id(ops)}"
            engine.add_request(rid, None, SamplingParams(max_tokens=max_tokens, n=n, temperature=0.5,
                                                         ignore_eos=True),
                               prompt_token_ids=prompt, cache_salt=salt)
            ids.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
        elif op[0] == "recover":   # as after a failed step
            engine.recover()
        elif ids:
            engine.abort(ids[op[1] % len(ids)])
        assert_exact_refcounts(engine)
    while engine.has_unfinished_requests():     # everything left finishes
        engine.step()
        assert_exact_refcounts(engine)
    s = engine.stats()
    assert s["running"] == s["waiting"] == 0
    assert s["num_blocks_held_by_requests"] == 0
    assert s["num_free_blocks"] == s["num_total_blocks"]
    assert all(c == 0 for c in engine.kv.pool.ref_cnt)


@pytest.mark.parametrize("name", ["engine", "window_engine"])
def test_the_property_run_exercised_preemption_and_sharing(request, name):
    """Guards the property tests above against a workload too gentle to mean anything."""
    s = request.getfixturevalue(name).stats()
    assert s["preemptions"] > 0
    assert s["prefix_cache_hit_tokens"] > 0
    assert s["prefix_cache_evictions"] > 0
    assert s["step_failures"] > 0
    assert 0 < s["kv_cache_bytes_peak"] <= s["kv_cache_bytes_total"]
    if name == "window_engine":
        assert s["window_slot_evictions"] > 0


def test_sharing_telemetry_counts_blocks_shared_by_live_requests(model_dirs):
    engine = LLMEngine(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=32, block_size=4))
    per_block = engine.runner.pool.bytes_per_block
    prompt = list(range(3, 3 + 13))                    # 3 full blocks + 1 token
    engine.add_request("a", None, SamplingParams(max_tokens=4, n=3, temperature=0.7, seed=1),
                       prompt_token_ids=prompt)
    engine.step()
    s = engine.stats()
    # Three samples share the 3 full prompt blocks; each holds its own last block.
    assert s["kv_cache_bytes_saved_by_sharing"] == 2 * 3 * per_block
    assert s["kv_cache_bytes_in_use"] == (3 + 3) * per_block
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats()
    assert s["kv_cache_bytes_saved_by_sharing"] == s["kv_cache_bytes_in_use"] == 0
    assert s["kv_cache_bytes_peak"] >= 6 * per_block
