"""Every engine path gives mlx-lm's greedy tokens, and its logprobs within tolerance.

Tolerance: |ours - mlx-lm| <= 2e-4 on the sampled token's logprob and on the top-5
logprobs, for float32 models (4e-3 for the 4-bit model, whose dequantized matmuls
reduce in another order). Random-weight models repeat tokens, so the logprob check is
what catches a wrong-but-plausible path.
"""

import random

import mlx.core as mx
import pytest

from runtime import EngineConfig, LLMEngine, SamplingParams
from runtime import engine as engine_module
from runtime import model_runner
from runtime.attention import metadata
from runtime.kv.paged_cache import PagedLayerCache

from .conftest import make_lora_adapter, needs_rope16_launch, reference_greedy

TOL = {"llama": 2e-4, "qwen3": 2e-4, "llama-4bit": 4e-3, "gemma3": 2e-4, "gpt-oss": 2e-4}
MAX_TOKENS = 12


def _params(n=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=n, logprobs=5, ignore_eos=True)


def _check(engine, out, prompt_ids, tol, max_tokens=MAX_TOKENS):
    ref = reference_greedy(engine.config.model, prompt_ids, max_tokens, engine.config.adapter_path)
    got = out.outputs[0]
    assert got.token_ids == [t for t, _ in ref], "greedy tokens differ from mlx-lm"
    for lp, (tok, ref_lp) in zip(got.logprobs, ref):
        assert abs(lp.logprob - ref_lp[tok].item()) <= tol
        for t, v in lp.top:
            assert abs(v - ref_lp[t].item()) <= tol
        # our top-5 really are mlx-lm's top-5
        ref_top = sorted(range(ref_lp.shape[0]), key=lambda i: -ref_lp[i].item())[:5]
        assert {t for t, _ in lp.top} == set(ref_top) or \
            abs(sorted(v for _, v in lp.top)[0] - ref_lp[ref_top[-1]].item()) <= tol


def _prompt(rng, n, vocab=384):
    return [rng.randrange(3, vocab) for _ in range(n)]


def _staggered(engine, prompts, every: int, count) -> dict:
    """Run `prompts` as requests r0, r1, ... to the end, admitting `count()` of them
    every `every` steps; their final outputs by request id."""
    outs, pending, steps = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % every == 0:
            n = count()
            for i, p in pending[:n]:
                engine.add_request(f"r{i}", None, _params(), prompt_token_ids=p)
            del pending[:n]
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        steps += 1
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-4bit", "gemma3", "gpt-oss"])
def arch(request, model_dirs):
    return request.param, model_dirs[request.param]


@pytest.mark.parametrize("length", [1, 2, 7, 15, 16, 17, 32, 33, 50])
def test_single_prompt_lengths(arch, length):
    name, path = arch
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=64, block_size=16))
    ids = _prompt(random.Random(length), length)
    out = engine.generate([ids], _params())[0]
    _check(engine, out, ids, TOL[name])
    assert engine.stats()["num_blocks_held_by_requests"] == 0


def test_concurrent_staggered_prefix_chunked_preempted(arch, monkeypatch):
    """20 requests, admitted at staggered steps, sharing prefixes, with a small token
    budget (chunked prefill) and a pool too small for all of them (preemption). Every
    step's tokens are processed on the engine's worker thread while the next step is
    queued (the path of large batches)."""
    monkeypatch.setattr(engine_module, "OVERLAP_MIN_SEQS", 1)
    name, path = arch
    rng = random.Random(7)
    shared = _prompt(rng, 40)
    prompts = []
    for i in range(20):
        tail = _prompt(rng, rng.randrange(1, 30))
        prompts.append(shared[: rng.choice([0, 16, 32, 40])] + tail)
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=24, block_size=8,
                                    max_num_batched_tokens=24, max_num_seqs=16))
    outs = _staggered(engine, prompts, 2, lambda: rng.randrange(1, 4))
    s = engine.stats()
    assert s["preemptions"] > 0, "the pool was meant to force preemption"
    assert s["prefix_cache_hit_tokens"] > 0
    assert s["num_blocks_held_by_requests"] == 0
    for i, p in enumerate(prompts):
        _check(engine, outs[f"r{i}"], p, TOL[name])


def _reference_prompt_logprobs(path, prompt_ids):
    from .conftest import _mlx_lm_model

    logits = _mlx_lm_model(path)(mx.array([prompt_ids]))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.mark.parametrize("pad_rows", [False, True])
def test_prompt_logprobs_match_mlx_lm(arch, monkeypatch, pad_rows):
    """Each prompt token's logprob (and the top 3 at its position) as mlx-lm's forward
    pass gives them: under chunked prefill, with the prompt already in the prefix cache
    (which a request with prompt logprobs must not use), beside requests that do use it,
    with n = 2, and on a pool small enough to preempt. `pad_rows`: the step's rows and
    logit rows padded to a grid, as on CUDA."""
    monkeypatch.setattr(engine_module, "OVERLAP_MIN_SEQS", 1)
    name, path = arch
    rng = random.Random(5)
    prompts = [_prompt(rng, n) for n in (40, 23, 57, 9)]
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=24, block_size=8, max_num_batched_tokens=24,
                                    max_num_seqs=6))
    engine.runner.pad_rows = pad_rows
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))   # now cached
    params = [SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=3, n=2 if i == 2 else 1,
                             ignore_eos=True) for i in range(len(prompts))]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = engine.generate(prompts + prompts[:2], params + [plain, plain])
    s = engine.stats()
    assert s["preemptions"] > 0, "the pool was meant to force preemption"
    assert outs[4].num_cached_tokens > 0 and outs[0].num_cached_tokens == 0
    assert s["num_blocks_held_by_requests"] == 0
    for p, out in zip(prompts, outs):
        ref = _reference_prompt_logprobs(path, p)
        assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
            assert lp.token_id == p[i] and abs(lp.logprob - ref[i - 1, p[i]].item()) <= TOL[name]
            assert len(lp.top) == 3
            for t, v in lp.top:
                assert abs(v - ref[i - 1, t].item()) <= TOL[name]
            assert lp.top[0][1] >= ref[i - 1].max().item() - TOL[name]
    assert outs[4].prompt_logprobs is None


def test_prompt_ending_on_block_boundary_hits_cache(model_dirs):
    path = model_dirs["llama"]
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=64, block_size=16))
    ids = _prompt(random.Random(3), 48)          # exactly 3 blocks
    first = engine.generate([ids], _params())[0]
    second = engine.generate([ids], _params())[0]
    # all but the last block can be reused: one token must be computed for logits
    assert second.num_cached_tokens == 32
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    _check(engine, second, ids, TOL["llama"])


def test_static_batching_matches(model_dirs):
    path = model_dirs["qwen3"]
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=128, enable_continuous_batching=False,
                                    max_num_seqs=4))
    rng = random.Random(11)
    prompts = [_prompt(rng, rng.randrange(1, 40)) for _ in range(6)]
    outs = engine.generate(prompts, _params())
    for p, o in zip(prompts, outs):
        _check(engine, o, p, TOL["qwen3"])


@needs_rope16_launch
def test_unchunked_prefill_matches(model_dirs):
    path = model_dirs["llama"]
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=128, enable_chunked_prefill=False,
                                    max_num_batched_tokens=4096, max_model_len=4096))
    rng = random.Random(5)
    prompts = [_prompt(rng, rng.randrange(1, 60)) for _ in range(5)]
    for p, o in zip(prompts, engine.generate(prompts, _params())):
        _check(engine, o, p, TOL["llama"])


def test_async_and_sync_scheduling_agree(default_model, monkeypatch):
    """Pipelined steps (the default), pipelined steps whose tokens are processed on the
    worker thread, and one-step-at-a-time give identical outputs, with stop strings,
    seeds, n > 1, logprobs and penalties (which force a sync) mixed in."""
    reqs = [
        ("The river", SamplingParams(temperature=0, max_tokens=30, stop=["mill"], logprobs=2)),
        ("The baker", SamplingParams(temperature=0.9, max_tokens=25, seed=5, n=3)),
        ("Question:", SamplingParams(temperature=0, max_tokens=20, frequency_penalty=1.0)),
        ("Hello!", SamplingParams(temperature=0.7, max_tokens=40, seed=11, top_p=0.9, top_k=20)),
    ]
    results = []
    for async_scheduling, overlap_min_seqs in ((False, 10**9), (True, 10**9), (True, 1)):
        monkeypatch.setattr(engine_module, "OVERLAP_MIN_SEQS", overlap_min_seqs)
        eng = LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=128,
                                     async_scheduling=async_scheduling))
        outs = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
        results.append([[(o.text, o.token_ids, o.finish_reason,
                          [(lp.token_id, round(lp.logprob, 5)) for lp in (o.logprobs or [])])
                         for o in r.outputs] for r in outs])
        assert eng.stats()["num_blocks_held_by_requests"] == 0
    assert results[0] == results[1] == results[2]
    assert results[0][0][0][2] == "stop" and "mill" not in results[0][0][0][0]


def test_priority_runs_first(default_model):
    eng = LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=128, max_num_seqs=1))
    p = SamplingParams(temperature=0, max_tokens=3)
    eng.add_request("low", "The river", p, priority=5)
    eng.add_request("high", "The river", p, priority=-5)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["high", "low"]


@pytest.mark.parametrize("unfused_max_queries, pad_steps",
                         [(0, metadata.PAD_STEPS), (0, 1), (metadata.UNFUSED_MAX_QUERIES, metadata.PAD_STEPS)])
def test_prefill_under_per_shape_plans_matches(arch, monkeypatch, unfused_max_queries, pad_steps):
    """What the engine does on CUDA, forced on here: prefill padded to a few sizes an
    octave (the threshold lowered to 0), or to powers of two (every group, with the
    limit at 0), or attended unfused (these chunks, all under the default limit, padded
    to their grid), and each step's rows padded to theirs. Ragged prompts chunked
    several to a step still give mlx-lm's tokens and logprobs."""
    monkeypatch.setattr(metadata, "UNFUSED_MAX_QUERIES", unfused_max_queries)
    monkeypatch.setattr(metadata, "FINE_PAD_QUERIES", 0)
    monkeypatch.setattr(metadata, "PAD_STEPS", pad_steps)
    name, path = arch
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=64, max_num_batched_tokens=40))
    engine.runner.plan_per_shape = engine.runner.pad_rows = True
    rng = random.Random(3)
    prompts = [_prompt(rng, n) for n in (3, 50, 17, 33)]
    for ids, out in zip(prompts, engine.generate(prompts, _params())):
        _check(engine, out, ids, TOL[name])


@needs_rope16_launch
def test_auto_compiles_small_gather_decode_batches_only(model_dirs):
    """Under `auto` with `gather`, decode steps of up to 8 sequences go through the
    compiled graph and larger ones run eagerly; outputs stay mlx-lm's either way."""
    from runtime.model_runner import GATHER_COMPILE_MAX_BATCH

    path = model_dirs["llama"]
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=128, max_num_seqs=12, attention_backend="gather"))
    graph = engine.runner.decode_graph
    assert graph is not None and graph.max_batch == GATHER_COMPILE_MAX_BATCH
    assert {b for b, _ in graph.traced} == {1, 2, 4, 8}
    rng = random.Random(21)
    prompts = [_prompt(rng, rng.randrange(2, 40)) for _ in range(12)]
    lengths = [4 + i for i in range(12)]   # the batch shrinks from 12 to 1 as they finish
    outs = engine.generate(prompts, [_params(n) for n in lengths])
    assert graph.used and max(b for b, _ in graph.used) <= GATHER_COMPILE_MAX_BATCH
    assert min(b for b, _ in graph.used) == 1
    for p, o, n in zip(prompts, outs, lengths):
        _check(engine, o, p, TOL["llama"], max_tokens=n)


def test_compiled_decode_matches(arch):
    """Decode steps through `mx.compile` (on by default with the CUDA kernel), forced on
    here: batches that grow and shrink pad to power-of-two buckets, traced at start-up,
    with chunked prefill and preemption around them, and still give mlx-lm's tokens
    and logprobs."""
    name, path = arch
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=12, block_size=8,
                                    max_num_batched_tokens=24, max_num_seqs=8, compile_decode=True))
    warm = set(engine.runner.decode_graph.traced)
    rng = random.Random(11)
    prompts = [_prompt(rng, rng.randrange(1, 30)) for _ in range(9)]
    outs = _staggered(engine, prompts, 3, lambda: 2)
    graph = engine.runner.decode_graph
    assert graph.used <= warm, "a step traced a bucket that start-up warm-up had not"
    assert any(b & (b - 1) == 0 and b > 2 for b, _ in graph.used), graph.used
    assert len(graph.used) > 2, "batches were meant to change size"
    assert engine.stats()["preemptions"] > 0
    assert engine.stats()["num_blocks_held_by_requests"] == 0
    for i, p in enumerate(prompts):
        _check(engine, outs[f"r{i}"], p, TOL[name])


def test_short_prefill_chunks_in_the_compiled_graph_match(arch, monkeypatch, caplog):
    """With `graph_prefill_tokens`, prefix hits' suffixes and short prompts join running
    decodes in the compiled graph, one row a token, each row attending its own
    sequence up to its position; longer chunks run eagerly beside. Tokens and logprobs
    stay mlx-lm's, and no step traces a batch bucket start-up had not."""
    from runtime.decode_graph import DecodeGraph

    with pytest.raises(ValueError, match="graph_prefill_tokens"):
        EngineConfig(graph_prefill_tokens=-1)
    name, path = arch
    with caplog.at_level("WARNING", logger="runtime.model_runner"):
        LLMEngine(EngineConfig(model=path, num_gpu_blocks=16, compile_decode=False, graph_prefill_tokens=4))
    assert "does nothing without compile_decode" in caplog.text
    calls = []
    call = DecodeGraph.__call__

    def spy(self, tokens, tables, positions):
        calls.append((len(tables), len({tuple(t) for t in tables})))
        return call(self, tokens, tables, positions)

    monkeypatch.setattr(DecodeGraph, "__call__", spy)
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=96, block_size=8, max_num_batched_tokens=64,
                                    max_num_seqs=8, compile_decode=True, graph_prefill_tokens=6))
    graph = engine.runner.decode_graph
    warm = {b for b, _ in graph.traced}
    rng = random.Random(17)
    shared = _prompt(rng, 40)
    engine.generate([shared + _prompt(rng, 2)], _params(1))
    prompts = [_prompt(rng, 30), shared + _prompt(rng, 3), shared + _prompt(rng, 9), _prompt(rng, 5),
               shared + _prompt(rng, 1), shared + _prompt(rng, 6), _prompt(rng, 20)]
    outs = _staggered(engine, prompts, 3, lambda: 1)
    assert any(rows > seqs for rows, seqs in calls), "no prefill chunk ran in the compiled graph"
    assert {b for b, _ in graph.used} <= warm
    assert engine.stats()["num_blocks_held_by_requests"] == 0
    for i, p in enumerate(prompts):
        _check(engine, outs[f"r{i}"], p, TOL[name])


@needs_rope16_launch
def test_prefix_hits_beside_a_new_prompt_in_one_step_match(arch, monkeypatch):
    """Prefix hits and a whole new prompt of about their context, prefilled in one
    step, are attended in groups of their own (the hits not padded to the prompt's
    length), and each gives mlx-lm's tokens and logprobs."""
    widths = []
    build = model_runner.build_metadata

    def spy(*args, **kwargs):
        meta = build(*args, **kwargs)
        widths.append([g.query_pos.shape[1] for g in meta.groups])
        return meta

    monkeypatch.setattr(model_runner, "build_metadata", spy)
    name, path = arch
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=160, block_size=8, max_num_batched_tokens=1024))
    rng = random.Random(13)
    shared = _prompt(rng, 160)
    engine.generate([shared + _prompt(rng, 3)], _params(1))
    prompts = [shared + _prompt(rng, n) for n in (2, 5, 9)] + [_prompt(rng, 200)]
    for ids, out in zip(prompts, engine.generate(prompts, _params())):
        _check(engine, out, ids, TOL[name])
    assert [200, 9] in widths
    assert engine.stats()["num_blocks_held_by_requests"] == 0


def test_last_layer_attends_for_sampling_rows_only(arch, monkeypatch):
    """A step whose rows do not all sample (a prompt's chunks beside decodes) has its
    last layer attend for the sampling rows alone, each as one query over its whole
    context; every output still matches mlx-lm's tokens and logprobs."""
    seen = []
    attend = PagedLayerCache.attend

    def spy(self, queries, scale, sinks=None):
        if self.last and self.ctx.sampled is not None:
            seen.append((queries.shape[0], self.ctx.sampled.rows.shape[0]))
        return attend(self, queries, scale, sinks)

    monkeypatch.setattr(PagedLayerCache, "attend", spy)
    name, path = arch
    engine = LLMEngine(EngineConfig(model=path, max_num_batched_tokens=24, num_gpu_blocks=64, block_size=8))
    rng = random.Random(21)
    prompts = {"early": _prompt(rng, 6), "long": _prompt(rng, 50), "mid": _prompt(rng, 17)}
    done = {}
    for rid, ids in prompts.items():
        engine.add_request(rid, None, _params(), prompt_token_ids=ids)
        for _ in range(2):      # the next prompt arrives while this one decodes
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert done.keys() == prompts.keys()
    for rid, ids in prompts.items():
        _check(engine, done[rid], ids, TOL[name])
    assert any(rows < t for t, rows in seen)       # a prompt chunk's rows left out
    assert engine.stats()["num_blocks_held_by_requests"] == 0


def test_lora_adapters_match_mlx_lm(arch, tmp_path):
    """`adapter_path`: the engine runs the model with mlx-lm's LoRA layers as mlx-lm
    applies them (their projections stay unfused): the same greedy tokens and logprobs
    as mlx-lm's decode with the adapters, paged, batched and chunked; and not the base
    model's."""
    name, path = arch
    adapter = make_lora_adapter(path, tmp_path / "adapter")
    engine = LLMEngine(EngineConfig(model=path, adapter_path=adapter, num_gpu_blocks=64, block_size=8,
                                    max_num_batched_tokens=24))
    rng = random.Random(11)
    prompts = [_prompt(rng, n) for n in (5, 19, 40)]
    outs = engine.generate([list(p) for p in prompts], _params())
    for p, out in zip(prompts, outs):
        _check(engine, out, p, TOL[name])
    base = [t for t, _ in reference_greedy(path, prompts[2], MAX_TOKENS)]
    assert outs[2].outputs[0].token_ids != base, "the adapter changed nothing: the test proves nothing"
    assert engine.stats()["num_blocks_held_by_requests"] == 0


def test_a_missing_adapter_is_a_clear_error(model_dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_path"):
        LLMEngine(EngineConfig(model=model_dirs["llama"], adapter_path=str(tmp_path / "nowhere")))
