"""Typed errors for bad input, unsupported models, and the async engine's lifecycle."""

import asyncio
import json
import math
import os
import shutil
import signal
import threading
import time

import mlx.core as mx
import pytest

from runtime import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from runtime import engine as engine_module
from runtime.models.loader import has_attention_sinks
from runtime.errors import (EmptyPromptError, EngineDeadError, EngineError, EngineStepError,
                            InvalidSamplingParamsError, PromptTooLongError, TokenOutOfVocabularyError,
                            UnsupportedModelError, DuplicateRequestError)

from .conftest import reference_greedy


@pytest.fixture(scope="module")
def engine(default_model):
    return LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=64, max_model_len=128))


@pytest.mark.parametrize("kwargs, exc", [
    (dict(prompt=""), EmptyPromptError),
    (dict(prompt_token_ids=[]), EmptyPromptError),
    (dict(prompt="x" * 400), PromptTooLongError),
    (dict(prompt="hi", params=SamplingParams(max_tokens=0)), InvalidSamplingParamsError),
    (dict(prompt="hi", params=SamplingParams(max_tokens=200)), PromptTooLongError),
    (dict(prompt="hi", params=SamplingParams(temperature=-1)), InvalidSamplingParamsError),
    (dict(prompt="hi", params=SamplingParams(top_p=1.5)), InvalidSamplingParamsError),
    (dict(prompt="hi", params=SamplingParams(logprobs=21)), InvalidSamplingParamsError),
    (dict(prompt="hi", params=SamplingParams(n=0)), InvalidSamplingParamsError),
    (dict(prompt="hi", params=SamplingParams(logit_bias={99999: 1})), InvalidSamplingParamsError),
    (dict(prompt="hi", params=SamplingParams(stop=["a"] * 17)), InvalidSamplingParamsError),
    (dict(prompt_token_ids=[1, 10**6]), TokenOutOfVocabularyError),
    (dict(prompt_token_ids=[-1]), TokenOutOfVocabularyError),
])
def test_bad_requests_raise_typed_errors(engine, kwargs, exc):
    params = kwargs.pop("params", SamplingParams(max_tokens=4))
    with pytest.raises(exc) as info:
        engine.add_request("bad", kwargs.pop("prompt", None), params, **kwargs)
    assert str(info.value)
    assert not engine.has_unfinished_requests()


def test_context_overflow_message_names_the_numbers(engine):
    with pytest.raises(PromptTooLongError, match="maximum context length is 128"):
        engine.add_request("long", None, SamplingParams(max_tokens=100), prompt_token_ids=[5] * 50)


def test_duplicate_request_id(engine):
    engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    engine.abort("dup")
    assert engine.stats()["num_blocks_held_by_requests"] == 0


def test_sliding_window_layers_are_served_as_mlx_lm_runs_them(tmp_path, default_model):
    """A Llama with sliding-window layers (mlx-lm gives them `RotatingKVCache`s) is
    served, attention held to the window: mlx-lm's greedy tokens for a prompt several
    windows long."""
    path = tmp_path / "swa"
    shutil.copytree(default_model, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"] * (cfg["num_hidden_layers"] // 2),
               sliding_window=8)
    (path / "config.json").write_text(json.dumps(cfg))
    engine = LLMEngine(EngineConfig(model=str(path), num_gpu_blocks=32, block_size=16))
    assert [c.window for c in engine.runner.caches] == [8, None] * (cfg["num_hidden_layers"] // 2)
    assert not has_attention_sinks(engine.runner.model)
    ids = list(range(3, 43))
    out = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == [t for t, _ in reference_greedy(str(path), ids, 8)]


def test_attention_sinks_are_found_where_a_model_has_them(tmp_path):
    """gpt-oss's layers hold sink logits, which the start-up self-check of a fused
    kernel must then cover; Gemma 3's sliding layers hold none."""
    from mlx_lm import load

    from runtime.models.tiny import make_model

    for arch, want in (("gpt_oss", True), ("gemma3_text", False)):
        path = make_model(tmp_path / arch, arch=arch, hidden=64, layers=2, heads=4, kv_heads=2, vocab_size=384,
                          seed=1, sliding_window=8)
        assert has_attention_sinks(load(str(path))[0]) is want


def test_caches_the_pool_cannot_hold_are_refused():
    """Chunked attention, a rotating cache that keeps its first tokens, quantized KV:
    each is a clear error naming the cache, never a silent full-attention layer."""
    from mlx_lm.models.cache import ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

    from runtime.models.loader import layer_windows

    class Layers:
        def __init__(self, caches):
            self.layers, self._caches = caches, caches

        def make_cache(self):
            return self._caches

    assert layer_windows(Layers([KVCache(), RotatingKVCache(max_size=8)])) == [None, 8]
    for odd in (ChunkedKVCache(16), RotatingKVCache(max_size=8, keep=4), QuantizedKVCache()):
        with pytest.raises(UnsupportedModelError, match=type(odd).__name__):
            layer_windows(Layers([KVCache(), odd]))


def test_unknown_architecture_is_refused(tmp_path, default_model):
    path = tmp_path / "weird"
    shutil.copytree(default_model, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "no_such_arch"
    cfg.pop("architectures")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="no_such_arch"):
        LLMEngine(EngineConfig(model=str(path), num_gpu_blocks=8))


def test_engine_device_choice(default_model, engine):
    """`device` picks MLX's device for the engine's process; a device this MLX build
    lacks is a clear error, never a silent fallback."""
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="tpu")
    for name in ("cpu", "gpu"):
        if not mx.is_available(getattr(mx, name)):
            with pytest.raises(ValueError, match="not available"):
                LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=8, device=name))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    eng = AsyncEngine(EngineConfig(model=default_model, num_gpu_blocks=64, device="cpu"), process=True)
    try:
        async def run():
            return [o async for o in eng.generate(params=params, prompt_token_ids=[5, 6, 7])][-1]
        out = asyncio.run(run())
    finally:
        eng.shutdown()
    assert len(out.outputs[0].token_ids) == 8
    if mx.default_device() == mx.cpu:
        assert out.outputs[0].token_ids == engine.generate([[5, 6, 7]], params)[0].outputs[0].token_ids


def test_engine_bounds_mlx_buffer_cache(default_model):
    """The engine bounds the freed buffers MLX keeps (process-wide): by default to a
    share of its KV pool, never above MLX's own limit; `buffer_cache_bytes` sets it."""
    with pytest.raises(ValueError, match="buffer_cache_bytes"):
        EngineConfig(buffer_cache_bytes=-1)
    mlx_own = mx.set_cache_limit(0)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    try:
        mx.set_cache_limit(64 << 30)
        eng = LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=64))
        want = max(1 << 30, eng.runner.pool.nbytes // 4)
        assert eng.buffer_cache_limit == want == mx.set_cache_limit(want)
        assert eng.stats()["device_memory_cache_limit_bytes"] == want
        eng.generate([[5, 6, 7]], params)
        assert mx.get_cache_memory() > 0        # freed step buffers kept for reuse
        eng.close()

        mx.set_cache_limit(32 << 20)             # below the bound: MLX's own stays
        eng = LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=64))
        assert eng.buffer_cache_limit == 32 << 20 == mx.set_cache_limit(32 << 20)
        eng.close()

        eng = LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=64, buffer_cache_bytes=0))
        assert eng.buffer_cache_limit == 0
        eng.generate([[5, 6, 7]], params)
        assert mx.get_cache_memory() == 0       # nothing kept past the bound
        eng.close()
    finally:
        mx.set_cache_limit(mlx_own)


@pytest.fixture(scope="module", params=[False, True], ids=["loop-on-thread", "loop-in-process"])
def async_engine(default_model, request):
    eng = AsyncEngine(EngineConfig(model=default_model, num_gpu_blocks=128), process=request.param)
    yield eng
    eng.shutdown()


def test_async_generate_streams_and_matches_sync(async_engine, engine):
    p = SamplingParams(temperature=0, max_tokens=20)

    async def run():
        outs = [o async for o in async_engine.generate("The baker", p)]
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and len(outs) > 1
    want = engine.generate(["The baker"], p)[0].outputs[0]
    assert outs[-1].outputs[0].token_ids == want.token_ids
    assert "".join(o.outputs[0].delta_text for o in outs) == want.text


def test_stream_interval_merges_outputs_without_losing_tokens(async_engine, engine):
    """A long interval leaves two outputs, the first token and the rest merged, and does
    not hold back the last one; their deltas still add up to exactly the tokens and
    text of an unmerged run."""
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def run(interval, cap=0.0):
        async def collect():
            return [o async for o in async_engine.generate("The baker", p, stream_interval_s=interval,
                                                           max_chunks_per_s=cap)]
        return await asyncio.wait_for(collect(), 30)   # well inside the 60 s interval

    merged, plain, whole = asyncio.run(run(60.0)), asyncio.run(run(0.0)), asyncio.run(run(math.inf))
    capped = asyncio.run(run(0.0, cap=1 / 60))   # one live stream at 1/60 chunk/s: a 60 s interval
    want = engine.generate(["The baker"], p)[0].outputs[0]
    assert len(merged) == 2 and len(capped) == 2 and len(whole) == 2 and len(plain) > 2
    assert len(merged[0].outputs[0].delta_token_ids) == 1
    assert async_engine.live_streams == 0
    for outs in (merged, capped, whole, plain):
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == want.token_ids
        assert "".join(o.outputs[0].delta_text for o in outs) == want.text
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == want.token_ids


def test_serve_bench_prompts_share_prefixes_only_by_design(async_engine):
    """Random prompts have their length and no shared first KV block (a prefix cache
    must not flatter the random workload); the prefix workload's do share theirs."""
    from bench import serve_bench as sb

    tok = async_engine.tokenizer
    src = sb.TextSource(tok, seed=5)
    ids = [tok.encode(r.prompt) for r in sb.random_workload(src, 200, 64, 4, 0.5)]
    assert all(32 - 2 <= len(i) <= 96 + 2 for i in ids)
    assert len({tuple(i[:16]) for i in ids}) == len(ids)
    fam = [tok.encode(r.prompt) for r in sb.prefix_workload(src, 8, 64, 2, 8, 4)]
    assert len({tuple(i[:48]) for i in fam}) == 2


def test_request_metrics_time_the_queue_and_the_prefill(default_model):
    """The first output with tokens and the last carry the engine's moments, in order;
    outputs between carry none. With room for one sequence, the second request waits
    for the whole first: its queue time holds the first's generation."""
    eng = LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=64, max_model_len=128, max_num_seqs=1))
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng.add_request("a", "The miller", p)
    eng.add_request("b", "The baker", p)
    outs: dict[str, list] = {"a": [], "b": []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].append(o)
    for rid, seq in outs.items():
        first, last = seq[0].metrics, seq[-1].metrics
        assert first is last and all(o.metrics is None for o in seq[1:-1])
        assert first.arrival_time <= first.first_scheduled_time < first.first_token_time
        assert first.queue_time >= 0 and first.prefill_time > 0
    a, b = outs["a"][0].metrics, outs["b"][0].metrics
    assert b.first_scheduled_time > a.first_token_time and b.queue_time > a.prefill_time


def test_async_engine_times_the_way_to_the_engine_and_back(async_engine):
    """The caller's moments bracket the engine's on one clock: sent, taken by the
    engine, scheduled, first token, back beside the caller, yielded. The parts add up
    to the time from sending to holding the first token, within what the caller saw."""
    p = SamplingParams(temperature=0, max_tokens=3)

    async def first():
        t0 = time.monotonic()
        async for out in async_engine.generate("The clockmaker", p):
            return out, time.monotonic() - t0

    out, seen = asyncio.run(first())
    m = out.metrics
    assert m.submitted_time <= m.arrival_time <= m.first_scheduled_time < m.first_token_time \
        <= m.received_time <= m.delivered_time
    parts = m.ttft_parts()
    assert list(parts) == ["engine_queue", "engine_prefill", "to_engine", "from_engine", "to_caller"]
    assert sum(parts.values()) == pytest.approx(m.delivered_time - m.submitted_time, abs=1e-9)
    assert sum(parts.values()) <= seen


def test_engine_counts_its_steps_by_duration(default_model, monkeypatch):
    """Every step lands in one bucket of `stats()`'s step-duration histogram, by how
    long it took; a step that stalls lands past the bounds, and the bench counts it
    among the steps over 160 ms."""
    from bench.compare import step_times
    from runtime.engine import STEP_TIME_BOUNDS_S

    eng = LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=64, max_model_len=128))
    eng.add_request("a", "The miller", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    before = eng.stats()
    assert sum(before["step_time_counts"]) == steps and before["step_seconds_total"] > 0
    assert list(before["step_time_bounds_s"]) == list(STEP_TIME_BOUNDS_S)
    monkeypatch.setattr(eng, "_step", lambda: time.sleep(1.5) or [])   # a stall past every bound
    eng.step()
    after = eng.stats()
    assert after["step_time_counts"][-1] == before["step_time_counts"][-1] + 1
    slow = step_times(before["step_time_counts"], after["step_time_counts"])
    assert slow["engine_steps_over_160ms"] == 1 and sum(slow["engine_step_time_counts"]) == 1


def test_serve_bench_engine_backend_counts_every_token(async_engine):
    from bench import serve_bench as sb

    src = sb.TextSource(async_engine.tokenizer, seed=1)
    reqs = sb.random_workload(src, 6, 24, 5, 0.5)
    extra = sb.eos_logit_bias(async_engine.tokenizer)
    s = asyncio.run(sb.run(sb.EngineBackend(async_engine, extra), reqs, max_concurrency=3, progress=False,
                           slo={"ttft": 60.0}, sampler=lambda: async_engine.stats()["running"]))
    assert s["completed"] == 6 and s["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert s["goodput"] == s["request_throughput"]          # a one-minute TTFT SLO is always met
    assert len(s["samples"]) >= 1
    split = s["server_timing_s"]                            # each TTFT in parts, the engine's among them
    assert set(split) == {"to_engine", "engine_queue", "engine_prefill", "from_engine", "to_caller"}
    assert 0 < split["engine_prefill"]["p50"] and split["engine_queue"]["p50"] + split["engine_prefill"]["p50"] \
        <= s["ttft_s"]["p95"]


def test_serve_bench_waits_out_its_arrivals(async_engine):
    """At a finite rate, a run sends each request after its gap (`arrival_gaps`), so it
    lasts at least their sum, and it records the burstiness it ran at."""
    from bench import serve_bench as sb

    reqs = sb.random_workload(sb.TextSource(async_engine.tokenizer, seed=2), 4, 8, 2, 0.0)
    s = asyncio.run(sb.run(sb.EngineBackend(async_engine), reqs, request_rate=10.0, seed=5, progress=False,
                           burstiness=0.5))
    assert s["completed"] == 4 and s["burstiness"] == 0.5
    assert s["duration_s"] >= sb.arrival_gaps(3, 10.0, 0.5, seed=5).sum() > 0


def test_serve_bench_engine_backend_paces_as_the_app(async_engine):
    """Paced as the app's replica paces (`compare.py`'s bare engine): the first token at
    once, then, with a minute's interval, everything else in the last chunk."""
    from bench import serve_bench as sb

    backend = sb.EngineBackend(async_engine, sb.eos_logit_bias(async_engine.tokenizer), stream_interval_s=60.0)
    res = asyncio.run(backend.send(sb.Request("a paced stream", None, 12), None))
    assert res.ok and res.output_tokens == 12 and len(res.itl) == 1


def test_async_cancel_frees_blocks(async_engine):
    p = SamplingParams(temperature=0.8, max_tokens=1500, ignore_eos=True)

    async def run():
        agen = async_engine.generate(prompt_token_ids=list(range(5, 100)), params=p)
        n = 0
        async for _ in agen:
            n += 1
            if n == 3:
                break
        await agen.aclose()
        for _ in range(300):
            s = async_engine.stats()
            if s["running"] == 0 and s["num_blocks_held_by_requests"] == 0 and async_engine.cached_block_hashes(8):
                return s
            await asyncio.sleep(0.02)
        return async_engine.stats()

    s = asyncio.run(run())
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["num_blocks_held_by_requests"] == 0
    assert async_engine.cached_block_hashes(8), "the 95-token prompt's full blocks are cached and reported"


def test_async_errors_surface_to_the_caller(async_engine):
    async def run():
        async for _ in async_engine.generate("", SamplingParams()):
            pass

    with pytest.raises(EmptyPromptError):
        asyncio.run(run())
    async_engine.check_health()


def test_async_many_concurrent(async_engine):
    p = SamplingParams(temperature=0, max_tokens=8)

    async def one(i):
        last = None
        async for o in async_engine.generate(f"Question {i}: what", p):
            last = o
        return last

    async def run():
        return await asyncio.gather(*(one(i) for i in range(24)))

    outs = asyncio.run(run())
    assert all(o.finished and len(o.outputs[0].token_ids) <= 8 for o in outs)
    # Idle again, the engine has handed MLX's buffer cache back.
    deadline = time.monotonic() + 10
    while async_engine.stats()["device_memory_cache_bytes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    s = async_engine.stats()
    assert s["device_memory_cache_bytes"] == 0 and s["running"] == s["waiting"] == 0
    assert s["device_memory_peak_bytes"] >= s["device_memory_active_bytes"] > 0


class _FailingCollect:
    """Fault injection for device errors (out of memory on Metal or CUDA), which cannot
    be produced on the CPU: reading a step's sampled tokens raises what MLX raises
    then, the next `times` reads."""

    def __init__(self, runner, times: int):
        self.orig, self.left = runner.collect, times

    def __call__(self, pending):
        if self.left > 0:
            self.left -= 1
            raise RuntimeError("[metal::malloc] Resource limit exceeded")
        return self.orig(pending)


def test_failed_step_aborts_its_requests_and_the_engine_goes_on(default_model, engine):
    """The running request gets `EngineStepError`; the waiting one is served with the
    tokens it would have had, and no block is left held."""
    eng = AsyncEngine(EngineConfig(model=default_model, num_gpu_blocks=128, max_num_seqs=1))
    runner = eng.engine.runner
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def consume(prompt, arm: bool):
        outs = []
        try:
            async for o in eng.generate(prompt, p):
                outs.append(o)
                if arm and len(outs) == 2:
                    runner.collect = _FailingCollect(runner, 1)
        except EngineStepError as e:
            return e
        return outs[-1]

    async def run():
        return await asyncio.gather(consume("The baker", True), consume("A river", False))

    try:
        failed, served = asyncio.run(run())
        assert isinstance(failed, EngineStepError) and "Resource limit" in str(failed)
        want = engine.generate(["A river"], p)[0].outputs[0]
        assert served.finished and served.outputs[0].token_ids == want.token_ids
        eng.check_health()
        s = eng.stats()
        assert s["step_failures"] == 1 and s["num_blocks_held_by_requests"] == 0
    finally:
        eng.shutdown()


def test_failure_queuing_a_step_keeps_the_outputs_processed_meanwhile(default_model, monkeypatch):
    """Large steps' tokens are processed on the worker thread while the next step is
    queued. If queuing fails (out of device memory), a request that finished in those
    tokens has left the engine, so `recover` cannot fail it: its output must still come
    out, with the next step, and no block may stay held."""
    monkeypatch.setattr(engine_module, "OVERLAP_MIN_SEQS", 1)
    eng = LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=64))
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = eng.generate(["The baker"], short)[0].outputs[0].token_ids
    eng.add_request("short", "The baker", short)
    eng.add_request("long", "A river", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    seq = eng.requests["short"].seqs[0]
    runner, real_finish_step = eng.runner, eng._finish_step

    def out_of_memory(pending):
        raise RuntimeError("[cuda::malloc] out of memory")

    def finish_step(pending, then=None):
        last = seq.num_prompt_tokens + short.max_tokens - 1
        if then is not None and any(s is seq and p == last for s, p in zip(pending.seqs, pending.positions)):
            monkeypatch.setattr(runner, "queue", out_of_memory)
        return real_finish_step(pending, then)

    monkeypatch.setattr(eng, "_finish_step", finish_step)
    outs = {}
    with pytest.raises(RuntimeError, match="out of memory"):
        while eng.has_unfinished_requests():
            outs.update((o.request_id, o) for o in eng.step())
    monkeypatch.undo()
    assert eng.recover() == ["long"]
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step())
    assert outs["short"].finished and outs["short"].outputs[0].token_ids == want
    assert not outs["long"].finished
    assert eng.stats()["num_blocks_held_by_requests"] == 0


def test_async_shutdown_stops_the_token_worker(default_model, monkeypatch):
    """The worker thread that processes large steps' tokens ends with the engine loop."""
    import threading

    monkeypatch.setattr(engine_module, "OVERLAP_MIN_SEQS", 1)
    eng = AsyncEngine(EngineConfig(model=default_model, num_gpu_blocks=64))

    async def run(i):
        async for o in eng.generate(f"Question {i}", SamplingParams(max_tokens=6, ignore_eos=True)):
            last = o
        return last

    async def main():
        return await asyncio.gather(*(run(i) for i in range(4)))

    def workers():
        return [t for t in threading.enumerate() if t.name.startswith("engine-tokens")]

    before = set(workers())
    try:
        assert all(o.finished for o in asyncio.run(main()))
        assert set(workers()) - before, "the steps were meant to use the worker thread"
    finally:
        eng.shutdown()
    assert not set(workers()) - before


def test_steps_that_keep_failing_stop_the_engine(default_model):
    eng = AsyncEngine(EngineConfig(model=default_model, num_gpu_blocks=64))
    eng.engine.runner.collect = _FailingCollect(eng.engine.runner, 100)

    async def run(i):
        try:
            async for _ in eng.generate(f"Question {i}", SamplingParams(max_tokens=4)):
                pass
        except EngineError as e:
            return e

    try:
        errors = [asyncio.run(run(i)) for i in range(3)]
        assert [type(e) for e in errors] == [EngineStepError, EngineStepError, EngineDeadError]
        with pytest.raises(EngineDeadError):
            eng.check_health()
    finally:
        eng.shutdown()


def test_a_stalled_loop_fails_its_request_and_its_health_check(default_model):
    """A step that does not return (here: one held until released) leaves the loop's
    thread alive but silent. An idle loop still comes round, so it stays healthy past
    `stall_timeout_s`; a stalled one fails the health check after it, and the request it
    held gets `EngineDeadError` instead of waiting forever."""
    eng = AsyncEngine(EngineConfig(model=default_model, num_gpu_blocks=64), stall_timeout_s=1.0)
    gate, step = threading.Event(), eng.engine.step

    def held():
        gate.wait(60)
        return step()

    async def run():
        await asyncio.sleep(1.5)
        eng.check_health()      # idle past the timeout: not a stall
        eng.engine.step = held
        pending = asyncio.ensure_future(
            eng.generate(None, SamplingParams(max_tokens=4), prompt_token_ids=[5, 6, 7]).__anext__())
        await asyncio.sleep(1.5)
        with pytest.raises(EngineDeadError, match="stalled"):
            eng.check_health()
        with pytest.raises(EngineDeadError, match="stalled"):
            await asyncio.wait_for(pending, 5)

    try:
        asyncio.run(run())
    finally:
        gate.set()
        eng.shutdown(timeout=10)


def test_a_stalled_engine_process_is_killed(default_model):
    """An engine process that stops coming round (here SIGSTOP) is killed by the health
    check that finds it stalled, so no hung engine holds the device after its server."""
    eng = AsyncEngine(EngineConfig(model=default_model, num_gpu_blocks=64, device="cpu"), process=True,
                      stall_timeout_s=1.0)
    proc = eng._core.proc
    try:
        time.sleep(1.5)
        eng.check_health()
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.5)
        with pytest.raises(EngineDeadError, match="stalled"):
            eng.check_health()
        assert proc.wait(10) == -signal.SIGKILL
        with pytest.raises(EngineDeadError, match="stalled"):   # the kill does not hide the cause
            eng.check_health()
    finally:
        eng.shutdown(timeout=5)


def test_health_reports_a_dead_engine_at_once(default_model):
    """`/health` asks the engine's health check, not only for its stats: those are its
    last report, which a dead engine still has, so the endpoint said 200 until Serve
    replaced the replica. Now it answers 503 as soon as the engine is gone."""
    from deployments.ingress import OpenAIIngress
    from deployments.llm_client import LocalLLM
    from deployments.llm_server import LLMServer
    from deployments.metrics import Metrics

    server = LLMServer({"model": default_model, "num_gpu_blocks": 32, "device": "cpu"}, engine_nice=None)
    ingress = OpenAIIngress.__new__(OpenAIIngress)   # only the engine client, metrics and a setting are read
    ingress.llm, ingress.metrics, ingress.s = LocalLLM(server), Metrics("default"), {"health_timeout_s": 5.0}
    try:
        assert asyncio.run(ingress.health()).status_code == 200
        server.engine._core.kill()
        server.engine._core.proc.wait(10)
        deadline = time.monotonic() + 10
        while server.engine._core.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats()["replica_id"] == server.replica_id   # the last report is still there
        assert asyncio.run(ingress.health()).status_code == 503
    finally:
        server.engine.shutdown(timeout=5)


def test_prompts_past_the_apps_inline_limit_are_tokenized_on_threads():
    """`tokenize_inline_chars` reaches the ingress from the app's arguments, and decides
    where a prompt is tokenized: below it on the event loop's thread, from it on the
    tokenizer pool."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from deployments.app import AppArgs, build_app
    from deployments.ingress import OpenAIIngress

    bound = build_app(AppArgs(colocate=True, tokenize_inline_chars=100))._bound_deployment
    settings = bound.init_args[1]
    assert settings["tokenize_inline_chars"] == 100
    ingress = OpenAIIngress.__new__(OpenAIIngress)   # only the settings and the pool are read
    ingress.s, ingress._tokenize_pool = settings, ThreadPoolExecutor(1)

    async def where(num_chars):
        return await ingress._tokenize(threading.current_thread, num_chars)
    try:
        assert asyncio.run(where(99)) is threading.main_thread()
        assert asyncio.run(where(100)) is not threading.main_thread()
    finally:
        ingress._tokenize_pool.shutdown()


def test_the_apps_tokenize_threads_tokenize_long_prompts_at_once(default_model):
    """`tokenize_threads` reaches the ingress from the app's arguments and sizes its
    tokenizer pool: that many long prompts tokenize at the same time (each waits here
    for the others to start), and one thread runs them one after another."""
    import threading

    from deployments.app import AppArgs, build_app
    from deployments.ingress import OpenAIIngress
    from deployments.llm_client import LocalLLM

    async def together(ingress, n):
        meet = threading.Barrier(n, timeout=2)
        return await asyncio.gather(*(ingress._tokenize(meet.wait, 1 << 20) for _ in range(n)))

    for threads, ok in ((2, True), (1, False)):
        bound = build_app(AppArgs(model=str(default_model), colocate=True, tokenize_threads=threads))
        settings = bound._bound_deployment.init_args[1]
        assert settings["tokenize_threads"] == threads
        ingress = OpenAIIngress(LocalLLM(None), settings)   # no engine: only its tokenizer pool works
        try:
            if ok:
                assert sorted(asyncio.run(together(ingress, 2))) == [0, 1]
            else:
                with pytest.raises(threading.BrokenBarrierError):
                    asyncio.run(together(ingress, 2))
        finally:
            ingress._tokenize_pool.shutdown()


def test_the_apps_switch_interval_reaches_the_replica_process(default_model):
    """`switch_interval_ms` reaches both halves of the app from its arguments, and a
    colocated replica runs with it; unset, Python's own interval stays."""
    import sys

    from deployments.app import AppArgs, build_app
    from deployments.colocated import ColocatedServer

    split = build_app(AppArgs(switch_interval_ms=0.5))._bound_deployment
    assert split.init_args[1]["switch_interval_ms"] == 0.5                 # the ingress's settings
    assert split.init_args[0]._bound_deployment.init_kwargs["switch_interval_ms"] == 0.5   # LLMServer's
    before = sys.getswitchinterval()
    for ms, want in ((None, before), (0.5, 0.0005)):
        bound = build_app(AppArgs(colocate=True, switch_interval_ms=ms,
                                  engine={"num_gpu_blocks": 32, "device": "cpu"}))._bound_deployment
        server_args, settings = bound.init_args[:2]
        server = ColocatedServer({**server_args, "engine_nice": None}, {**settings, "model": default_model})
        try:
            assert sys.getswitchinterval() == pytest.approx(want)
        finally:
            server.server.engine.shutdown(timeout=5)
            sys.setswitchinterval(before)


def test_ingress_answers_a_failed_step_with_503():
    """The replica's error item for a request aborted by a failed step or a dead engine
    becomes 503 with Retry-After (a retry can succeed); a bad request stays 400."""
    import json as _json

    from deployments.ingress import OpenAIIngress
    from deployments.llm_server import error_item

    ingress = OpenAIIngress.__new__(OpenAIIngress)   # only its settings are read
    ingress.s = {"retry_after_s": 2}
    failed = ingress._item_error(error_item(EngineStepError("step failed"))["error"]).response()
    assert failed.status_code == 503 and failed.headers["retry-after"] == "2"
    assert _json.loads(failed.body)["error"]["type"] == "server_error"
    dead = ingress._item_error(error_item(EngineDeadError("engine loop stopped"))["error"]).response()
    assert dead.status_code == 503 and _json.loads(dead.body)["error"]["code"] == "engine_dead"
    bad = ingress._item_error(error_item(EmptyPromptError())["error"]).response()
    assert bad.status_code == 400 and _json.loads(bad.body)["error"]["param"] == "prompt"


def test_delta_outputs_add_up_to_the_whole_last_one(async_engine):
    """`output_kind="delta"` (what the replica streams to the ingress): before the last
    output only deltas travel; they still add up to the last output's text, tokens and
    logprobs, and the last one is whole, prompt included."""
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, output_kind="delta")

    async def run():
        return [o async for o in async_engine.generate(prompt_token_ids=list(range(5, 60)), params=p)]

    sent = asyncio.run(run())
    assert len(sent) > 2
    for o in sent[:-1]:
        c = o.outputs[0]
        assert o.prompt_token_ids == [] and c.token_ids == [] and c.text == "" and c.logprobs is None
    last = sent[-1].outputs[0]
    assert [t for o in sent for t in o.outputs[0].delta_token_ids] == last.token_ids
    assert "".join(o.outputs[0].delta_text for o in sent) == last.text
    assert [lp.token_id for o in sent for lp in o.outputs[0].delta_logprobs] == last.token_ids
    assert len(last.logprobs) == len(last.token_ids) == 12
    assert sent[-1].prompt_token_ids == list(range(5, 60))