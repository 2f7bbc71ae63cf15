"""Sampling parameters, detokenization and stop conditions on the real engine."""

import pytest

from runtime import EngineConfig, LLMEngine, SamplingParams
from runtime.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def engine(default_model):
    return LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=256))


PROMPT = "The river ran quietly past the old"


def test_seed_is_reproducible_inside_any_batch(engine):
    p = SamplingParams(temperature=1.0, max_tokens=20, seed=1234)
    alone = engine.generate([PROMPT], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=20) for _ in range(5)]
    batch = engine.generate([PROMPT, "Hello", "The baker", PROMPT, "Numbers", PROMPT],
                            [others[0], others[1], others[2], p, others[3], others[4]])
    assert batch[3].outputs[0].token_ids == alone
    other_seed = engine.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=20, seed=99))
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    greedy = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=15))[0].outputs[0]
    k1 = engine.generate([PROMPT], SamplingParams(temperature=2.0, top_k=1, max_tokens=15))[0].outputs[0]
    p0 = engine.generate([PROMPT], SamplingParams(temperature=2.0, top_p=1e-6, max_tokens=15))[0].outputs[0]
    mp = engine.generate([PROMPT], SamplingParams(temperature=2.0, min_p=0.999, max_tokens=15))[0].outputs[0]
    assert k1.token_ids == greedy.token_ids == p0.token_ids == mp.token_ids


def test_logit_bias_forces_and_bans(engine):
    tok = engine.tokenizer.encode(" apples")[-1]
    out = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5,
                                                   logit_bias={tok: 100}))[0].outputs[0]
    assert out.token_ids == [tok] * 5
    greedy = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0]
    banned = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1,
                                                      logit_bias={greedy.token_ids[0]: -100}))
    assert banned[0].outputs[0].token_ids != greedy.token_ids


def test_penalties_discourage_repeats(model_dirs):
    """Random-weight models repeat tokens under greedy decoding; each penalty must cut that."""
    eng = LLMEngine(EngineConfig(model=model_dirs["llama"], num_gpu_blocks=64))
    prompt = [7, 8, 9, 10]
    plain = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    plain = plain[0].outputs[0].token_ids
    top = max(set(plain), key=plain.count)
    assert plain.count(top) >= 4, "the reference output should repeat a token"
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 5.0}):
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw)
        toks = eng.generate([prompt], p)[0].outputs[0].token_ids
        assert max(toks.count(t) for t in set(toks)) < plain.count(top), kw


def test_logprobs_are_the_models_before_penalties_and_bias(engine):
    """Logprobs report the model's own distribution, as vLLM's do by default: the first
    position's are the same whatever penalties or bias change what is sampled, alone or
    beside a request without them."""
    free = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, logprobs=5))[0].outputs[0]
    for kw in ({"repetition_penalty": 3.0}, {"presence_penalty": 2.0}, {"logit_bias": {free.token_ids[0]: -100}}):
        pen = SamplingParams(temperature=0, max_tokens=2, logprobs=5, **kw)
        for out in engine.generate([PROMPT, "Hello"], [pen, SamplingParams(max_tokens=2)])[:1] + \
                engine.generate([PROMPT], pen):
            first = out.outputs[0].logprobs[0]
            assert [t for t, _ in first.top] == [t for t, _ in free.logprobs[0].top], kw
            assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(first.top, free.logprobs[0].top))


def test_logprobs_shape(engine):
    out = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for lp, tok in zip(out.logprobs, out.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok     # greedy picks the top token
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_stop_string_straddling_tokens(engine):
    full = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].text
    assert "miller" in full
    out = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, stop=["mil", "zzz"]))[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop"
    assert o.text == full[: full.index("mil")]


def test_stop_token_eos_and_length(engine):
    p = SamplingParams(temperature=0, max_tokens=3)
    o = engine.generate([PROMPT], p)[0].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 3
    first = o.token_ids[0]
    o2 = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[first]))[0]
    assert o2.outputs[0].finish_reason == "stop" and o2.outputs[0].token_ids == [first]
    eos = next(iter(engine.eos_token_ids))
    o3 = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100}))[0]
    assert o3.outputs[0].finish_reason == "stop" and o3.outputs[0].text == ""


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(engine):
    """Before `min_tokens` neither EOS (even at +100 bias) nor a stop id is sampled and no
    stop string ends the request; the tokens are greedy's with those banned; then they
    stop it as before. Also in a batch whose steps overlap (16 requests)."""
    eos = next(iter(engine.eos_token_ids))
    no_eos = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8,
                                                      logit_bias={eos: -100}))[0].outputs[0]
    outs = engine.generate([PROMPT] * 16, SamplingParams(temperature=0, max_tokens=8, min_tokens=5,
                                                         logit_bias={eos: 100}))
    for o in outs:
        o = o.outputs[0]
        assert o.finish_reason == "stop" and o.token_ids == no_eos.token_ids[:5] + [eos]
    first = no_eos.token_ids[0]
    banned = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3,
                                                      logit_bias={eos: -100, first: -100}))[0].outputs[0]
    o = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, min_tokens=3,
                                                 stop_token_ids=[first]))[0].outputs[0]
    assert o.token_ids[:3] == banned.token_ids
    assert o.finish_reason == "length" or o.token_ids[-1] in (first, eos)
    assert first not in o.token_ids[:-1]
    full = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    stop = [engine.tokenizer.decode(full.token_ids[:1])]
    assert engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, stop=stop))[0].outputs[0].text == ""
    o = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, min_tokens=2, stop=stop))[0].outputs[0]
    assert len(o.token_ids) > 2 and full.text.startswith(o.text)
    if o.finish_reason == "stop":   # a later occurrence still stops it
        assert full.text[len(o.text):].startswith(stop[0])
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request("m", PROMPT, SamplingParams(max_tokens=4, min_tokens=5))


def test_streamed_deltas_add_up(engine):
    engine.add_request("s", PROMPT, SamplingParams(temperature=0, max_tokens=25, stop=["daughter"]))
    text, toks = "", []
    while engine.has_unfinished_requests():
        for o in engine.step():
            text += o.outputs[0].delta_text
            toks += o.outputs[0].delta_token_ids
            last = o
    assert text == last.outputs[0].text and toks == last.outputs[0].token_ids


def test_detokenizer_never_emits_broken_utf8(engine):
    text = "naïve café — 日本語 ✓"
    ids = engine.tokenizer.encode(text)
    d = IncrementalDetokenizer(engine.tokenizer._tokenizer, [], [])
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.take(final=False))
    pieces.append(d.take(final=True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_text_ending_inside_a_character_is_the_tokens_decoded(engine):
    """A sequence cut off by length between a character's bytes keeps them as U+FFFD,
    as decoding its tokens whole writes them, streamed and whole; the detokenizer holds
    such bytes back only while a later token may complete the character."""
    tok = engine.tokenizer
    begins = tok.encode("日本", add_special_tokens=False)[:2]   # bytes of one character, not all
    assert tok.decode(begins[:1]).endswith("\ufffd")
    for n in (1, 2, 5):
        p = SamplingParams(temperature=0, max_tokens=n, logit_bias={t: 100 for t in begins})
        engine.add_request(f"cut{n}", PROMPT, p)
        streamed = ""
        while engine.has_unfinished_requests():
            for o in engine.step():
                streamed += o.outputs[0].delta_text
                last = o.outputs[0]
        assert last.finish_reason == "length" and len(last.token_ids) == n
        assert last.text == tok.decode(last.token_ids) == streamed
        assert last.text.endswith("\ufffd")
