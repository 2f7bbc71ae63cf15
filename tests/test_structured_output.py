"""Structured outputs: greedy tokens under a constraint equal mlx-lm's greedy decode with
the same constraint applied as a logits processor, on every engine path; the text obeys
the constraint; bad constraints are typed errors and leave nothing behind.

The reference builds its own llguidance matcher and unpacks its bitmask with numpy, so
it shares nothing with the engine but llguidance itself. Logprobs are the model's raw
distribution (before the mask), compared within the tolerance of test_correctness."""

import json
import random
import time

import mlx.core as mx
import numpy as np
import pytest
from llguidance import LLMatcher, LLTokenizer

from runtime import EngineConfig, LLMEngine, SamplingParams
from runtime import StructuredOutputsParams as SO
from runtime import engine as engine_module
from runtime.errors import InvalidRequestError

from .conftest import _mlx_lm_model

TOL = 2e-4
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["answer", "score", "tags", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": SO(json=SCHEMA),
    "json_schema_text": SO(json=json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "minItems": 2, "maxItems": 4})),
    "json_object": SO(json_object=True),
    "regex": SO(regex=r"(cat|dog)s? [0-9]{2}!"),
    "choice": SO(choice=("red", 'say "hi"', "back\\slash", "ünï")),
    "grammar": SO(grammar='start: "<" item ("," item)* ">"\nitem: /[a-c]{1,3}/'),
}


def _reference(path, tokenizer, eos, prompt_ids, so: SO, max_tokens):
    """mlx-lm's greedy decode with the constraint as a logits processor: the tokens up
    to the grammar's end (or EOS, or max_tokens) and each step's raw logprobs."""
    from mlx_lm.generate import generate_step

    backend = tokenizer.backend_tokenizer
    vocab = _mlx_lm_model(path).args.vocab_size
    lt = LLTokenizer(backend.to_str(), n_vocab=max(vocab, backend.get_vocab_size()), eos_token=sorted(eos))
    masker, tracker = (LLMatcher(lt, so.spec) for _ in range(2))
    seen, raw = [len(prompt_ids)], []

    def constrain(tokens, logits):
        for t in tokens[seen[0]:].tolist():
            assert masker.consume_token(t)
        seen[0] = len(tokens)
        words = np.frombuffer(masker.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(words, bitorder="little")[: logits.shape[-1]].astype(bool)
        raw.append(logits[0] - mx.logsumexp(logits[0]))
        return mx.where(mx.array(allowed)[None], logits, -mx.inf)

    out = []
    for tok, _ in generate_step(mx.array(prompt_ids), _mlx_lm_model(path), max_tokens=max_tokens,
                                sampler=lambda lp: mx.argmax(lp, axis=-1), logits_processors=[constrain]):
        tok = int(tok)
        out.append(tok)
        if tok in eos or len(out) == max_tokens:
            break
        assert tracker.consume_token(tok)
        if tracker.is_stopped():
            break
    return out, raw[: len(out)]


def _check(engine, out, prompt_ids, so, max_tokens):
    ref, raw = _reference(engine.config.model, engine.tokenizer._tokenizer, engine.eos_token_ids,
                          prompt_ids, so, max_tokens)
    got = out.outputs[0]
    assert got.token_ids == ref, "constrained greedy tokens differ from mlx-lm's"
    for lp, ref_lp in zip(got.logprobs, raw):
        assert abs(lp.logprob - ref_lp[lp.token_id].item()) <= TOL
    return got


def _valid(text: str, so: SO) -> bool:
    """Whether a finished text obeys the constraint, checked without llguidance where
    Python can (JSON, the regex, the choices)."""
    import re

    if so.json is not None or so.json_object:
        value = json.loads(text)
        if so.json_object:
            return isinstance(value, dict)
        if isinstance(so.json, dict):
            return (set(value) == set(SCHEMA["required"]) and value["answer"] in ("yes", "no", "maybe")
                    and 0 <= value["score"] <= 99 and isinstance(value["ok"], bool)
                    and len(value["tags"]) <= 2 and all(len(t) <= 6 for t in value["tags"]))
        return isinstance(value, list) and 2 <= len(value) <= 4 and all(0 <= v <= 9 for v in value)
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    if so.choice is not None:
        return text in so.choice
    return re.fullmatch(r"<[a-c]{1,3}(,[a-c]{1,3})*>", text) is not None


@pytest.fixture(scope="module")
def engine(model_dirs):
    return LLMEngine(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=128, block_size=8))


def _params(so, max_tokens=40, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, structured_outputs=so, **kw)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_greedy_matches_mlx_lm_under_each_constraint(engine, kind):
    so = CONSTRAINTS[kind]
    ids = [random.Random(kind).randrange(3, 384) for _ in range(11)]
    got = _check(engine, engine.generate([ids], _params(so, 60))[0], ids, so, 60)
    if got.finish_reason == "stop":
        assert _valid(got.text, so), got.text
    else:   # the budget ran out first: what there is follows the grammar so far
        assert got.finish_reason == "length" and kind in ("json_object", "grammar")
    assert engine.stats()["num_blocks_held_by_requests"] == 0


def test_unconstrained_neighbours_are_untouched(engine):
    """Constrained and free requests in one batch: each gives what it gives alone."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(4, 20))] for _ in range(6)]
    kinds = ["json_schema", None, "regex", None, "choice", "grammar"]
    params = [_params(CONSTRAINTS[k]) if k else SamplingParams(temperature=0.0, max_tokens=20, logprobs=0)
              for k in kinds]
    together = engine.generate(prompts, params)
    for p, sp, out in zip(prompts, params, together):
        alone = engine.generate([p], sp)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    free = [o.outputs[0].text for o, k in zip(together, kinds) if k is None]
    assert all(len(o.outputs[0].token_ids) == 20 for o, k in zip(together, kinds) if k is None), free


def test_chunked_preempted_and_overlapped_paths_match(model_dirs, monkeypatch):
    """Constrained requests under chunked prefill, preemption (a small pool) and token
    processing on the worker thread, with free requests around them."""
    monkeypatch.setattr(engine_module, "OVERLAP_MIN_SEQS", 1)
    engine = LLMEngine(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=20, block_size=8,
                                    max_num_batched_tokens=16, max_num_seqs=8))
    rng = random.Random(11)
    shared = [rng.randrange(3, 384) for _ in range(24)]
    cases = []
    for i in range(10):
        ids = shared[: rng.choice([0, 8, 24])] + [rng.randrange(3, 384) for _ in range(rng.randrange(2, 30))]
        kind = rng.choice([None, "json_schema", "regex", "grammar", "json_schema_text"])
        cases.append((f"r{i}", ids, kind))
        sp = _params(CONSTRAINTS[kind], 30) if kind else SamplingParams(temperature=0.0, max_tokens=30)
        engine.add_request(f"r{i}", None, sp, prompt_token_ids=ids)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert engine.stats()["preemptions"] > 0, "the pool was meant to force preemption"
    assert engine.stats()["num_blocks_held_by_requests"] == 0
    for rid, ids, kind in cases:
        if kind:
            _check(engine, outs[rid], ids, CONSTRAINTS[kind], 30)


def test_sampled_outputs_obey_the_schema(engine):
    """Sampling at temperature 1 with top-p and n > 1: every completion is a valid,
    complete object of the schema, and a seed gives the same ones again."""
    so = CONSTRAINTS["json_schema"]
    sp = SamplingParams(temperature=1.0, top_p=0.95, n=4, seed=5, max_tokens=60, structured_outputs=so)
    first = engine.generate("Answer in JSON:", sp)[0]
    for c in first.outputs:
        assert c.finish_reason == "stop" and _valid(c.text, so), c.text
    again = engine.generate("Answer in JSON:", sp)[0]
    assert [c.text for c in again.outputs] == [c.text for c in first.outputs]


def test_length_cut_leaves_a_prefix_of_the_grammar(engine):
    so = CONSTRAINTS["json_schema"]
    out = engine.generate("x", _params(so, max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text == "{\"answer"


@pytest.mark.parametrize("bad, words", [
    (SO(regex="[a-"), "regex"),
    (SO(json={"type": "objectx"}), "json"),
    (SO(json="{not json"), "json constraint"),
    (SO(grammar="start: undefined_rule"), "grammar"),
    (SO(choice=()), "choice"),
    (SO(choice=("a", "")), "choice"),
    (SO(regex="a", choice=("a",)), "exactly one"),
    (SO(), "exactly one"),
])
def test_bad_constraints_are_typed_errors(engine, bad, words):
    with pytest.raises(InvalidRequestError, match=words) as e:
        engine.add_request("bad", "hi", _params(bad))
    assert e.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests()
    assert engine.generate("hi", _params(CONSTRAINTS["choice"]))[0].outputs[0].text in CONSTRAINTS["choice"].choice


def test_a_thinking_model_reasons_freely_then_answers_in_the_grammar(format_model):
    """A model whose vocabulary has "<think>" (mlx-lm gives it a thinking format): the
    constraint holds what follows the reasoning. Where the prompt opens the reasoning,
    the tokens are free until "</think>" (pushed here by a bias), then JSON of the
    schema; otherwise the first token may open it, and the same follows; where the
    prompt closes it (`enable_thinking: false`) or the model answers at once, the first
    token is already held."""
    from runtime.structured_output import reasoning_state

    engine = LLMEngine(EngineConfig(model=format_model, num_gpu_blocks=128))
    tok = engine.tokenizer
    start, end = tok.think_start_tokens[0], tok.think_end_tokens[0]
    msgs = [{"role": "user", "content": "Answer in JSON."}]
    prompt = {kw: tok.apply_chat_template(msgs, add_generation_prompt=True, **dict(kw))
              for kw in ((), (("think_open", True),), (("enable_thinking", False),))}
    states = [reasoning_state(tok, ids) for ids in prompt.values()]
    assert states == ["may_think", "thinking", "answer"]
    so = CONSTRAINTS["json_schema"]
    opened = engine.generate([prompt[(("think_open", True),)]], _params(so, 80, logit_bias={end: 100.0}))[0]
    out = opened.outputs[0]
    assert out.token_ids[0] == end and out.finish_reason == "stop"
    assert _valid(out.text.split("</think>", 1)[1], so), out.text
    # This random model opens its reasoning when it may; pushed to close it, it answers.
    out = engine.generate([prompt[()]], _params(so, 80, logit_bias={end: 100.0}))[0].outputs[0]
    assert out.token_ids[:2] == [start, end] and out.finish_reason == "stop"
    assert _valid(out.text.split("</think>", 1)[1], so), out.text
    # Kept from opening it, or told not to think, it is held from its first token.
    for kw, bias in (((), {start: -100.0}), ((("enable_thinking", False),), {})):
        out = engine.generate([prompt[kw]], _params(so, 80, logit_bias=bias))[0].outputs[0]
        assert start not in out.token_ids and out.finish_reason == "stop" and _valid(out.text, so), out.text


def test_may_think_lets_the_start_marker_through_first(format_model):
    from runtime.structured_output import GrammarCompiler

    engine = LLMEngine(EngineConfig(model=format_model, num_gpu_blocks=16))
    start, end = engine.tokenizer.think_start_tokens[0], engine.tokenizer.think_end_tokens[0]
    compiler = GrammarCompiler(engine.tokenizer._tokenizer, engine.vocab_size, engine.eos_token_ids)
    g = compiler.compile(CONSTRAINTS["choice"], (start, end), "may_think")
    row = np.zeros(g.words, dtype=np.uint32)
    g.fill(row)
    allowed = set(np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0])
    assert start in allowed and end not in allowed and len(allowed) > 1
    assert g.consume(start) and g.state == "thinking" and not g.masks
    assert g.consume(7) and g.consume(end) and g.state == "answer" and g.masks
    plain = compiler.compile(CONSTRAINTS["choice"], (start, end), "may_think")
    red = engine.tokenizer.encode("red")[0]
    assert plain.consume(red) and plain.state == "answer"


def test_a_grammar_compiled_before_is_copied_untouched(engine):
    """The second request of a schema gets a copy of the first's compiled matcher, never
    the one the first advanced: the same tokens, whole."""
    so = SO(json=SCHEMA)
    ids = [random.Random("json_schema").randrange(3, 384) for _ in range(11)]
    first = engine.generate([ids], _params(so, 60))[0].outputs[0]
    assert engine.grammar_compiled(_params(SO(json=json.loads(json.dumps(SCHEMA)))))
    assert not engine.grammar_compiled(_params(SO(regex="never seen [0-9]+")))
    second = engine.generate([ids], _params(SO(json=dict(SCHEMA)), 60))[0].outputs[0]
    assert first.finish_reason == "stop" and _valid(first.text, so)
    assert second.token_ids == first.token_ids


class _HeldCompile:
    """`LLMEngine.compile_grammar` that waits for `release` (set from the test) before
    compiling: a grammar that takes as long as the test wants."""

    def __init__(self, monkeypatch):
        import threading

        self.release, self.started = threading.Event(), threading.Event()
        real = LLMEngine.compile_grammar

        def held(engine_self, params, prompt_ids):
            self.started.set()
            assert self.release.wait(60), "the test never released the compile"
            return real(engine_self, params, prompt_ids)

        monkeypatch.setattr(LLMEngine, "compile_grammar", held)


def test_a_grammar_compiles_off_the_loop_while_other_requests_run(model_dirs, monkeypatch):
    """The engine loop compiles a new grammar on a thread of its own: a free request
    finishes while the compile is held, which it never could with the compile on the
    loop. Then the constrained request gets the engine's own tokens for it."""
    import asyncio

    from runtime import AsyncEngine

    so = SO(regex=r"(cat|dog)s? [0-9]{2}!")
    want = LLMEngine(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=64)).generate(
        ["The baker"], _params(so, 20))[0].outputs[0]
    held = _HeldCompile(monkeypatch)
    eng = AsyncEngine(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=64))

    async def last(prompt, params):
        async for o in eng.generate(prompt, params):
            out = o
        return out

    async def main():
        constrained = asyncio.ensure_future(last("The baker", _params(so, 20)))
        await asyncio.get_running_loop().run_in_executor(None, held.started.wait, 30)
        free = await asyncio.wait_for(last("A river", SamplingParams(max_tokens=12, ignore_eos=True)), 60)
        assert not constrained.done()
        for _ in range(100):   # the loop reports every turn; give a loaded host time
            if eng.stats()["waiting"] == 1:
                break
            await asyncio.sleep(0.05)
        assert eng.stats()["waiting"] == 1, "a request whose grammar compiles is waiting"
        held.release.set()
        return free, await asyncio.wait_for(constrained, 60)

    try:
        free, constrained = asyncio.run(main())
        assert free.finished and len(free.outputs[0].token_ids) == 12
        assert constrained.outputs[0].token_ids == want.token_ids and constrained.outputs[0].text == want.text
        assert eng.stats()["num_blocks_held_by_requests"] == 0
    finally:
        held.release.set()
        eng.shutdown()


@pytest.mark.parametrize("process", [False, True], ids=["loop-on-thread", "loop-in-process"])
def test_a_grammar_that_fails_to_compile_off_the_loop_is_a_typed_error(model_dirs, process):
    import asyncio

    from runtime import AsyncEngine

    eng = AsyncEngine(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=64), process=process)

    async def run(so):
        async for o in eng.generate("hi", _params(so, 8)):
            out = o
        return out

    try:
        # The vocabulary's grammar index is built beside the loop once it is ready, not
        # by the first structured request.
        deadline = time.monotonic() + 30
        while not eng.stats().get("grammar_index_built") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.stats()["grammar_index_built"]
        with pytest.raises(InvalidRequestError, match="grammar") as e:
            asyncio.run(run(SO(grammar="start: undefined_rule", param="response_format")))
        assert e.value.param == "response_format"
        assert asyncio.run(run(CONSTRAINTS["choice"])).outputs[0].text in CONSTRAINTS["choice"].choice
        eng.check_health()
        assert eng.stats()["num_blocks_held_by_requests"] == 0
    finally:
        eng.shutdown()


def test_a_request_cancelled_while_its_grammar_compiles_never_runs(model_dirs, monkeypatch):
    """Cancelled while its grammar is held compiling, a request never joins the engine:
    once the compile ends, only the requests sent after it have counted prompt tokens."""
    import asyncio
    import time

    from runtime import AsyncEngine

    held = _HeldCompile(monkeypatch)
    eng = AsyncEngine(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=64))

    async def free(prompt):
        async for o in eng.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True)):
            out = o
        return out

    async def main():
        gen = eng.generate("The baker", _params(SO(regex="[a-z]{30}"), 20), "cancelled")
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.get_running_loop().run_in_executor(None, held.started.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen.aclose()
        first = await free("A river")      # the abort has reached the loop before this
        held.release.set()
        time.sleep(0.5)                    # the compile ends; the loop comes round
        return first, await free("A river")

    try:
        first, second = asyncio.run(main())
        assert first.finished and second.finished
        assert eng.stats()["prompt_tokens"] == 2 * len(first.prompt_token_ids)
        assert eng.stats()["num_blocks_held_by_requests"] == 0
    finally:
        held.release.set()
        eng.shutdown()


def test_a_grammar_checked_before_is_not_checked_again(monkeypatch):
    """The server's front checks each distinct grammar once: clients send the same
    schemas and tool sets again and again, and a large one takes milliseconds."""
    from runtime import structured_output

    calls = []
    real = LLMatcher.validate_grammar
    monkeypatch.setattr(structured_output.LLMatcher, "validate_grammar",
                        staticmethod(lambda spec: calls.append(spec) or real(spec)))
    schema = {"type": "object", "properties": {"checked_once": {"type": "integer"}}}
    assert not structured_output.grammar_checked(SO(json=schema).spec)
    SO(json=schema).validate()
    SO(json=dict(schema)).validate()
    assert len(calls) == 1 and structured_output.grammar_checked(SO(json=schema).spec)
    bad = SO(regex="[a-", param="response_format")
    for _ in range(2):
        with pytest.raises(InvalidRequestError) as e:
            bad.validate()
        assert e.value.param == "response_format"
    assert len(calls) == 2
