"""Prefill attention plans built ahead of use (runtime/attention/prefill_plans.py).

On CUDA each new prefill shape costs a plan build; the engine queues the batch sizes a
shape has not met yet and builds them while idle. Here, on any device, shape padding
is turned on as CUDA does it: the queue, its bounds, the idle-time loop, and outputs
that stay mlx-lm's."""

import random
import threading

from runtime import EngineConfig, LLMEngine, SamplingParams
from runtime.attention import paged_kernel
from runtime.engine_loop import EngineLoop

from .test_correctness import TOL, _check, _params, _prompt


def _engine(path, **kw):
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=64, max_num_seqs=8,
                                    max_num_batched_tokens=64, **kw))
    engine.runner.pad_prefill_shapes()
    return engine


def test_siblings_queued_within_bounds_and_built(model_dirs):
    """A 20-token prompt runs a (1 sequence, 32 queries, 4 blocks) prefill group. Its
    siblings at other batch sizes are queued while their padded query rows fit the
    64-token budget (2 sequences, not 4 or 8); building one runs attention in exactly
    that padded shape; the same shape in a later step adds nothing; outputs match."""
    path = model_dirs["llama"]
    engine = _engine(path)
    plans = engine.runner.prefill_plans
    shapes = []
    attention = plans._attention

    def spy(q, meta, scale):
        g = meta.groups[0]
        shapes.append((*g.query_pos.shape, g.block_tables.shape[1]))
        return attention(q, meta, scale)

    plans._attention = spy
    rng = random.Random(5)
    first = _prompt(rng, 20)
    _check(engine, engine.generate([first], _params())[0], first, TOL["llama"])
    assert plans.built >= {(1, 32, 4)}
    assert plans.pending == 1 and engine.has_idle_work()
    assert engine.stats()["prefill_plans_pending"] == 1
    engine.idle_work()
    assert shapes == [(2, 32, 4)] and (2, 32, 4) in plans.built
    assert not engine.has_idle_work() and engine.stats()["prefill_plans_pending"] == 0

    pair = [_prompt(rng, 18), _prompt(rng, 25)]   # one step, one (2, 32, 4) group
    for ids, out in zip(pair, engine.generate(pair, _params())):
        _check(engine, out, ids, TOL["llama"])
    assert plans.pending == 0 and shapes == [(2, 32, 4)]


def test_idle_work_waits_for_requests(model_dirs):
    """Plans are built only between requests: with a request running, `idle_work` does
    nothing."""
    engine = _engine(model_dirs["llama"])
    rng = random.Random(6)
    engine.generate([_prompt(rng, 20)], _params(2))
    assert engine.has_idle_work()
    engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=2),
                       prompt_token_ids=_prompt(rng, 24))   # the same (32 queries, 4 blocks) bucket
    engine.idle_work()
    assert engine.runner.prefill_plans.pending == 1
    while engine.has_unfinished_requests():
        engine.step()
    engine.idle_work()
    assert engine.runner.prefill_plans.pending == 0


def test_engine_loop_builds_plans_while_idle(model_dirs, monkeypatch):
    """The step loop as it runs on CUDA (shape padding on by itself): once its request
    is done it polls for commands without blocking and builds the queued plans, then
    blocks again; a stop still ends it."""
    monkeypatch.setattr(paged_kernel, "available", lambda dialect: dialect == "cuda")
    loop = EngineLoop(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=64, max_num_seqs=8,
                                   max_num_batched_tokens=64, attention_backend="gather"))
    ids = _prompt(random.Random(7), 20)
    seen, events = [], []

    def recv(block):
        engine = loop.engine
        pending = engine.runner.prefill_plans.pending
        seen.append((block, engine.has_unfinished_requests(), pending))
        if len(seen) == 1:
            return [("add", "a", {"prompt": None, "params": _params(4), "prompt_token_ids": ids})]
        if (pending == 0 and not engine.has_unfinished_requests()) or len(seen) > 500:
            return [("stop",)]
        return []

    want = LLMEngine(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=64)).generate(
        [ids], _params(4))[0].outputs[0].token_ids
    thread = threading.Thread(target=loop.run, args=(recv, events.extend))   # as it runs in a server
    thread.start()
    thread.join(120)
    assert not thread.is_alive() and events[-1] == ("stopped",)
    outs = [o for e in events if e[0] == "outputs" for o in e[1]]
    assert [o for o in outs if o.finished][0].outputs[0].token_ids == want
    idle_with_work = [b for b, busy, pending in seen[1:] if not busy and pending]
    assert idle_with_work and not any(idle_with_work), "the loop blocked with plans to build"
    assert seen[-1][2] == 0 and len(seen) < 500
    assert loop.engine.runner.prefill_plans.built >= {(1, 32, 4), (2, 32, 4)}
