"""The prefix cache is shared between live requests, measured, and salted per tenant."""

import pytest

from runtime import EngineConfig, LLMEngine, SamplingParams
from runtime.kv.block_pool import BlockPool
from runtime.kv.prefix_cache import PrefixCache, block_hashes

BS = 16


@pytest.fixture()
def engine(model_dirs):
    return LLMEngine(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=64, block_size=BS))


PREFIX = [5 + (i * 7) % 300 for i in range(3 * BS)]   # three full blocks


def test_second_request_hits_three_blocks(engine):
    p = SamplingParams(max_tokens=4, temperature=0)
    engine.generate([PREFIX + [9, 10]], p)
    before = engine.stats()
    out = engine.generate([PREFIX + [11, 12, 13]], p)[0]
    after = engine.stats()
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= 3 * BS
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"] + 1
    assert out.num_cached_tokens == 3 * BS
    assert out.usage["cached_tokens"] == 3 * BS


def test_concurrent_requests_hold_the_prefix_blocks_once(engine):
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("a", None, p, prompt_token_ids=PREFIX + [20, 21])
    engine.add_request("b", None, p, prompt_token_ids=PREFIX + [30, 31, 32])
    engine.step()
    a, b = engine.requests["a"].seqs[0], engine.requests["b"].seqs[0]
    assert a.block_ids[:3] == b.block_ids[:3]
    assert a.block_ids[3] != b.block_ids[3]
    for blk in a.block_ids[:3]:
        assert engine.kv.pool.ref_cnt[blk] == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_blocks_held_by_requests"] == 0


def test_n_completions_share_the_prompt_blocks(engine):
    engine.add_request("n3", None, SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1),
                       prompt_token_ids=PREFIX + [40])
    engine.step()
    seqs = engine.requests["n3"].seqs
    assert seqs[0].block_ids[:3] == seqs[1].block_ids[:3] == seqs[2].block_ids[:3]
    assert engine.kv.pool.ref_cnt[seqs[0].block_ids[0]] == 3
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out.finished and len(out.outputs) == 3
    assert all(len(o.token_ids) == 5 for o in out.outputs)


def test_different_salts_never_share(engine):
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("t1", None, p, prompt_token_ids=PREFIX + [1], cache_salt="tenant-a")
    engine.add_request("t2", None, p, prompt_token_ids=PREFIX + [1], cache_salt="tenant-b")
    engine.step()
    a, b = engine.requests["t1"].seqs[0], engine.requests["t2"].seqs[0]
    assert not set(a.block_ids) & set(b.block_ids)
    while engine.has_unfinished_requests():
        engine.step()
    out_b = engine.generate([PREFIX + [2]], p)  # unsalted: no hit on salted blocks
    assert out_b[0].num_cached_tokens == 0
    engine.add_request("t3", None, p, prompt_token_ids=PREFIX + [3], cache_salt="tenant-a")
    engine.step()
    assert engine.requests["t3"].seqs[0].num_cached_tokens == 3 * BS


def test_cache_outlives_requests_and_evicts_lru():
    pool = BlockPool(4)
    cache = PrefixCache(pool)
    hashes = block_hashes(list(range(16)), 4)
    blocks = [cache.allocate() for _ in range(4)]
    for h, b in zip(hashes, blocks):
        cache.insert(h, b)
    pool.release(reversed(blocks))              # freed tail first: tail is LRU
    assert cache.lookup(hashes, 16, 4) == blocks  # still cached after release
    fresh = cache.allocate()
    assert fresh == blocks[-1] and cache.stats.evictions == 1
    assert cache.lookup(hashes, 16, 4) == blocks[:3]


def test_block_hash_is_stable_and_salted():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a == block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != a[1]
    salted = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "x")
    assert salted[0] != a[0] and salted[1] != a[1]     # the salt reaches every chained block
    assert a[0].hex() == block_hashes([1, 2, 3, 4], 4)[0].hex()


def test_the_router_reads_each_new_report_of_a_replicas_cache():
    """A replica's next report can hold as many hashes as the last, newest first the
    same, and still differ: the router matches against the report it has now."""
    from types import SimpleNamespace

    from deployments.router import PrefixAwareRouter

    router = PrefixAwareRouter.__new__(PrefixAwareRouter)   # its matching alone, outside a Serve cluster
    router.initialize_state()
    hashes = block_hashes(list(range(32)), 16, None)
    replica = SimpleNamespace(replica_id="r", routing_stats={"block_hashes": [b"newest", b"other"]})
    assert router._match(hashes, replica, 16) == 0
    replica.routing_stats = {"block_hashes": [b"newest", hashes[0]]}
    assert router._match(hashes, replica, 16) == 1
