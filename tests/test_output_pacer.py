"""How outputs leave the engine: a large step's as soon as the worker thread has
processed them, while the next step is still being queued; and the engine loop paces
each request's outputs: the first and the last at once, the ones between at most once
per interval, merged, and held ones never leave it."""

import math
import queue
import threading

import pytest

from runtime import EngineConfig, LLMEngine, SamplingParams
from runtime import engine as engine_module
from runtime.engine_loop import EngineLoop
from runtime.output_pacer import OutputPacer
from runtime.outputs import CompletionOutput, RequestOutput


def out(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    c = CompletionOutput(0, "", [], None, "length" if finished else None,
                         delta_text="".join(f"<{t}>" for t in tokens), delta_token_ids=list(tokens))
    return RequestOutput(rid, None, [], [c], finished)


def test_first_and_last_leave_at_once_the_rest_once_per_interval_merged():
    pacer = OutputPacer()
    pacer.add("a", interval=1.0)
    pacer.add("plain")
    sent = []
    for step in range(6):    # steps at t = 0, 0.4, 0.8, 1.2, 1.6, 2.0; "a" finishes on the last
        now = 0.4 * step
        sent += pacer.release([out("a", [step], finished=step == 5), out("plain", [step])], now)
    a = [o for o in sent if o.request_id == "a"]
    assert [o.outputs[0].delta_token_ids for o in a] == [[0], [1, 2, 3], [4, 5]]
    assert a[1].outputs[0].delta_text == "<1><2><3>" and a[-1].finished
    assert len([o for o in sent if o.request_id == "plain"]) == 6   # unpaced: every step
    assert len(pacer) == 0    # "plain" was never paced, "a" is done


def test_the_cap_stretches_the_interval_with_the_paced_requests():
    pacer = OutputPacer()
    for rid in "abcd":
        pacer.add(rid, max_chunks_per_s=4.0)    # four streams, four chunks a second: 1 s each
    sent = []
    for step in range(5):
        sent += pacer.release([out(rid, [step]) for rid in "abcd"], 0.25 * step)
    assert [len([o for o in sent if o.request_id == r]) for r in "abcd"] == [2, 2, 2, 2]  # t = 0 and 1.0


def test_dropped_and_whole_requests():
    pacer = OutputPacer()
    pacer.add("gone", interval=10.0)
    pacer.add("whole", interval=math.inf)
    assert len(pacer.release([out("gone", [1]), out("whole", [1])], 0.0)) == 2
    assert pacer.release([out("gone", [2]), out("whole", [2])], 1.0) == []
    pacer.drop("gone")
    last = pacer.release([out("whole", [3], finished=True)], 50.0)
    assert [o.outputs[0].delta_token_ids for o in last] == [[2, 3]]
    assert len(pacer) == 0


def test_engine_loop_sends_only_paced_outputs(default_model, monkeypatch):
    """A 60 s interval: of 30 tokens the loop emits two outputs (the first token, then
    the other 29 with the last), whose deltas are exactly the unpaced tokens, text and
    logprobs; and the engine makes only those two, none to be held."""
    cfg = EngineConfig(model=default_model, num_gpu_blocks=64, max_model_len=128)
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    want = LLMEngine(cfg).generate(["The baker"], p)[0].outputs[0]
    made = []
    make = LLMEngine._output
    monkeypatch.setattr(LLMEngine, "_output", lambda self, req: made.append(req.request_id) or make(self, req))
    commands: queue.Queue = queue.Queue()
    emitted: list = []
    done = threading.Event()

    def recv(block: bool) -> list:
        try:
            return [commands.get(timeout=0.1 if block else 0)]
        except queue.Empty:
            return []

    def emit(events: list) -> None:
        for ev in events:
            if ev[0] == "outputs":
                emitted.extend(ev[1])
                if any(o.finished for o in ev[1]):
                    done.set()

    loop = EngineLoop(cfg)
    t = threading.Thread(target=loop.run, args=(recv, emit), daemon=True)
    t.start()
    commands.put(("add", "r", dict(prompt="The baker", params=p, stream_interval_s=60.0)))
    assert done.wait(60)
    commands.put(("stop",))
    t.join(30)
    assert [len(o.outputs[0].delta_token_ids) for o in emitted] == [1, 29]
    assert [t for o in emitted for t in o.outputs[0].delta_token_ids] == want.token_ids
    assert "".join(o.outputs[0].delta_text for o in emitted) == want.text
    assert [lp for o in emitted for lp in o.outputs[0].delta_logprobs] == want.logprobs
    assert made == ["r", "r"]
    assert len(loop.pacer) == 0


def test_a_large_steps_outputs_leave_while_the_next_step_is_queued(default_model):
    """With an `output_sink`, a step of at least `OVERLAP_MIN_SEQS` sequences hands its
    outputs on from the worker thread while the main thread is still queuing the next
    step; a step processed inline returns its outputs from `step()`. Every token
    arrives once, in order."""
    cfg = EngineConfig(model=default_model, num_gpu_blocks=512, max_model_len=128, max_num_seqs=64)
    n = engine_module.OVERLAP_MIN_SEQS + 4
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [f"Order {i} of the bakery" for i in range(n)]
    want = {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(LLMEngine(cfg).generate(prompts, p))}

    eng = LLMEngine(cfg)
    queuing = threading.Event()
    queue = eng.runner.queue

    def slow_queue(pending):
        queuing.set()
        try:
            queue(pending)
            threading.Event().wait(0.05)   # a window the worker's hand-off must fall in
        finally:
            queuing.clear()

    eng.runner.queue = slow_queue
    got: dict[str, list[int]] = {}
    during_queue: list[bool] = []

    def sink(outputs):
        during_queue.append(queuing.is_set() and threading.current_thread() is not threading.main_thread())
        for o in outputs:
            got.setdefault(o.request_id, []).extend(o.outputs[0].delta_token_ids)

    eng.output_sink = sink
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", prompt, p)
    returned = 0
    while eng.has_unfinished_requests():
        outputs = eng.step()
        returned += len(outputs)
        sink(outputs)
    eng.close()
    assert got == want
    assert any(during_queue) and returned > 0   # large steps early; the last, inline, from step()


@pytest.mark.parametrize("case", ["cpu", "gpu", "gpu, large step", "gpu, device behind"])
def test_a_first_token_leaves_before_the_next_step_is_built(default_model, monkeypatch, case):
    """A small step that samples a request's first token is read back, and its output
    handed to the sink, before the next step is built, on the CPU backend (queuing a
    step computes it) and on a GPU (queuing only encodes; set here). On a GPU it keeps
    the overlap (its output leaves from the worker while the next step is queued) for a
    step over `EARLY_READ_MAX_TOKENS`, and while reading back blocks on the device. On
    the CPU every later step hands its outputs off from the worker too; on a GPU a small
    step processes them inline."""
    cfg = EngineConfig(model=default_model, num_gpu_blocks=64, max_model_len=128)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLMEngine(cfg).generate(["The miller"], p)[0].outputs[0].token_ids
    eng = LLMEngine(cfg)
    eng._queue_computes = case == "cpu"
    if case == "gpu, large step":
        monkeypatch.setattr(engine_module, "EARLY_READ_MAX_TOKENS", 2)
    if case == "gpu, device behind":
        collect = eng.runner.collect

        def slow_collect(pending):
            threading.Event().wait(2 * engine_module.EARLY_READ_MAX_BLOCK_S)
            return collect(pending)

        eng.runner.collect = slow_collect
    got, events = [], []   # events: "build", or (sink called from the worker, carried the first token)
    build = eng.runner.build

    def logged_build(*args, **kwargs):
        events.append("build")
        return build(*args, **kwargs)

    def sink(outputs):
        events.append((threading.current_thread() is not threading.main_thread(), not got))
        got.extend(t for o in outputs for t in o.outputs[0].delta_token_ids)

    eng.runner.build = logged_build
    eng.output_sink = sink
    if case == "gpu, device behind":   # reading this one back shows the device behind
        eng.add_request("w", "The weaver", p)
        while eng.has_unfinished_requests():
            eng.step()
        got.clear()
        events.clear()
    eng.add_request("r", "The miller", p)
    while eng.has_unfinished_requests():
        got.extend(t for o in eng.step() for t in o.outputs[0].delta_token_ids)
    eng.close()
    assert got == want
    handed = [e for e in events if e != "build"]
    if case in ("cpu", "gpu"):
        assert events[:3] == ["build", (False, True), "build"]
    else:
        assert events[:3] == ["build", "build", (True, True)]
    if case == "cpu":
        assert all(worker for worker, _ in handed[1:])
    else:
        assert len(handed) == 1
