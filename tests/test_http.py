"""The real app under `serve run`, driven by the official `openai` client and httpx."""

import asyncio
import json
import os
import re
import time
from pathlib import Path
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from bench.compare import step_time_counts
from bench.serve_bench import parse_server_timing
from runtime import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from runtime.engine import STEP_TIME_BOUNDS_S

from .serving import ServeRun, app, engine_pids, live_pids, metric, process_env, replica_pids

KEY = "sk-test-tenant-a"
ENGINE_PARTS = ("to_engine", "engine_queue", "engine_prefill", "from_engine", "to_caller")
MODEL = "default"


@pytest.fixture(scope="module")
def server(format_model, mistral_model, harmony_model):
    """Each app twice: as two deployments (ingress and LLMServer) and colocated; and the
    embedded model with a chat template that has a tool-call format, with Mistral's
    (that one without a response store) and with gpt-oss's harmony format."""
    small = {"max_num_seqs": 16, "kv_cache_memory_bytes": 64 << 20}
    ingress = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1}}
    apps = []
    for prefix, colocate in (("", False), ("colo-", True)):
        split = {} if colocate else {"ingress": ingress}
        apps += [
            app(f"{prefix}main", f"/{prefix}main", served_model_name=MODEL, engine=small, colocate=colocate,
                llm_server={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25},
                            "max_ongoing_requests": 64},
                max_request_body_bytes=64 << 10, stream_interval_ms=0, **split),
            app(f"{prefix}secure", f"/{prefix}secure", served_model_name=MODEL, engine=small,
                api_keys=[KEY, "sk-other"], colocate=colocate,
                llm_server={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25},
                            "max_ongoing_requests": 1, "max_queued_requests": 1}, **split),
        ]
    apps.append(app("formats", "/formats", model=format_model, served_model_name=MODEL, engine=small, colocate=True,
                    llm_server={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25}}, stream_interval_ms=0))
    apps.append(app("mistral", "/mistral", model=mistral_model, served_model_name=MODEL, engine=small, colocate=True,
                    llm_server={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25}}, stream_interval_ms=0,
                    response_store={"enabled": False}))
    apps.append(app("harmony", "/harmony", model=harmony_model, served_model_name=MODEL, engine=small, colocate=True,
                    llm_server={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25}}, stream_interval_ms=0))
    srv = ServeRun(apps)
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["main", "colo-main"])
def front(request):
    """The app a test talks to: ingress and LLMServer apart, or colocated."""
    return request.param


@pytest.fixture(scope="module", params=["secure", "colo-secure"])
def secure(request):
    return request.param


@pytest.fixture(scope="module")
def client(server, front):
    return openai.OpenAI(base_url=server.urls[front] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine(default_model):
    return LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=512))


def test_startup_time_is_reasonable(server):
    print(f"serve run ready in {server.startup_s:.1f}s")
    assert server.startup_s < 120


def test_models_list_and_retrieve(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == engine.max_model_len   # vLLM's field: the context a client may use
    assert models[0].root == "default" and "/" not in models[0].root   # the directory's name, not its path
    assert client.models.retrieve(MODEL).model_dump() == models[0].model_dump()
    for other in ("gpt-4o", "mlx-community/Llama-3.2-1B-Instruct-4bit"):   # the client escapes the '/'
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(other)
        assert e.value.body["code"] == "model_not_found" and repr(other) in e.value.body["message"]


def test_completion_matches_engine(client, engine):
    prompt = "The baker rose before the sun to"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    want = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0]
    assert r.choices[0].text == want.outputs[0].text
    assert r.choices[0].finish_reason == want.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_matches(client, engine):
    prompt = "A library is a quiet place where"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert text == want.text and len(chunks) > 3
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_token_prompt_list_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=[[260, 283, 81], [260]], max_tokens=5,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    e = client.completions.create(model=MODEL, prompt="The river", max_tokens=5, temperature=0, echo=True)
    assert e.choices[0].text.startswith("The river") and len(e.choices[0].text) > len("The river")


def test_chat_matches_engine(client, engine):
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What does the baker need?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    ids = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = engine.generate([list(ids)], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids)


def test_chat_takes_openais_bookkeeping_fields(client, server, front):
    """`store`, `metadata`, `service_tier`, `prompt_cache_key`, `prompt_cache_retention`,
    `safety_identifier`, text-only `modalities`, `verbosity` and a `prediction`, which
    some clients always send, change nothing, nor do null `audio`, `web_search_options`,
    `functions` and `function_call`; another modality, or retention, is a 400, and so is
    any value of those four, saying why."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    r = client.chat.completions.create(**kw, store=False, metadata={"team": "a"}, service_tier="auto",
                                       prompt_cache_key="k1", prompt_cache_retention="24h", safety_identifier="u1",
                                       modalities=["text"], verbosity="low",
                                       prediction={"type": "content", "content": "Hello there"},
                                       audio=None, web_search_options=None, functions=None, function_call=None)
    assert r.choices[0].message.content == plain
    refused = {"audio": ({"voice": "alloy", "format": "wav"},
                         "audio output is not supported: this server answers in text"),
               "web_search_options": ({}, "web search is not supported: this server has no built-in tools"),
               "functions": ([{"name": "f", "parameters": {"type": "object"}}],
                             "functions is OpenAI's deprecated form of tools: send tools"),
               "function_call": ("auto", "function_call is OpenAI's deprecated form of tool_choice: send tool_choice")}
    for field, value in [("modalities", ["audio"]), ("prompt_cache_retention", "forever"),
                         *((f, v) for f, (v, _) in refused.items())]:
        bad = httpx.post(server.urls[front] + "/v1/chat/completions", json={**kw, field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith(field)
        if field in refused:
            assert bad.json()["error"]["message"] == f"{field}: {refused[field][1]}"


def test_chat_stream_with_usage_and_content_parts(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}],
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_continuous_usage_stats_in_every_chunk(client):
    """`continuous_usage_stats` (vLLM's extension, with `include_usage`): every chunk
    carries the usage so far, the prompt's tokens throughout and the completion's
    growing from 0 (the role chunk) to the total of the last chunk."""
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final.completion_tokens == 12
    made = [c.usage.completion_tokens for c in chunks]
    assert made[0] == 0 and made == sorted(made) and made[-2] == 12
    assert all(c.usage.prompt_tokens == final.prompt_tokens > 0 for c in chunks)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    plain = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 12


def test_long_prompts_tokenized_off_the_loop_match(server, front, engine):
    """Prompts long enough to be tokenized on the ingress's threads, eight at once on
    each endpoint: each request gets its own prompt's tokens and the engine's greedy
    text."""
    from deployments.app import AppArgs

    words = "river baker clock lantern harbor meadow signal orchard".split()
    prompts = [" ".join(words[(i + j) % len(words)] + str(j % (i + 2)) for j in range(60)) for i in range(8)]
    assert min(map(len, prompts)) > AppArgs.model_fields["tokenize_inline_chars"].default
    chats = [[{"role": "user", "content": p}] for p in prompts]

    async def ask():
        c = openai.AsyncOpenAI(base_url=server.urls[front] + "/v1", api_key="unused", max_retries=0)
        done = await asyncio.gather(
            *(c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts),
            *(c.chat.completions.create(model=MODEL, messages=m, max_tokens=6, temperature=0) for m in chats))
        await c.close()
        return done[:8], done[8:]

    completions, chat = asyncio.run(ask())
    params = SamplingParams(temperature=0, max_tokens=6)
    chat_ids = [list(engine.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True))
                for m in chats]
    for p, r, want in zip(prompts, completions, engine.generate(prompts, params)):
        assert r.usage.prompt_tokens == len(engine.tokenizer.encode(p))
        assert r.choices[0].text == want.outputs[0].text
    for ids, r, want in zip(chat_ids, chat, engine.generate(chat_ids, params)):
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].message.content == want.outputs[0].text


def test_long_prompts_sharing_a_start_reuse_its_tokens(server, front, client, engine):
    """A document before each of several questions, and a chat whose history grows by
    a turn: the ingress tokenizes each only past the start it shares with an earlier one
    (its `prompt_token_cache_*` metrics count the tokens it took), and every request
    still gets its own prompt's tokens and the engine's greedy text."""
    from runtime.prompt_token_cache import MIN_CHARS

    url = server.urls[front]
    words = "river baker clock lantern harbor meadow signal orchard".split()
    doc = " ".join(f"{words[(j * 5) % 8]}{j % 13}" for j in range(400)) + "\n\n"
    assert len(doc) > MIN_CHARS
    def counts(text: str) -> dict[str, float]:
        got = dict(re.findall(r'^mlx_paged_serve:prompt_token_cache_prompts_total{.*how="(\w+)".*} (\S+)$', text, re.M))
        return {how: float(got.get(how, 0)) for how in ("reused", "whole")}

    text = httpx.get(url + "/metrics").text
    before, tokens_before = counts(text), metric(text, "prompt_token_cache_reused_tokens_total") or 0.0
    prompts = [doc + q for q in ("Who keeps the mill?", "Where does the river go?", "When was the clock set?")]
    params = SamplingParams(temperature=0, max_tokens=5)
    for p, want in zip(prompts, engine.generate(prompts, params)):
        got = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": p}, timeout=60).json()
        assert got["tokens"] == list(engine.tokenizer.encode(p))
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
        assert r.usage.prompt_tokens == got["count"] and r.choices[0].text == want.outputs[0].text
    msgs = [{"role": "system", "content": doc}]
    for q in ("Who keeps the mill?", "And the clock?"):
        msgs.append({"role": "user", "content": q})
        ids = list(engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        got = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": msgs}, timeout=60).json()
        assert got["tokens"] == ids
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
        want = engine.generate([ids], params)[0].outputs[0].text
        assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == want
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    text = httpx.get(url + "/metrics").text
    assert metric(text, "prompt_token_cache_enabled") == 1.0
    # Whole: the first question and the first chat turn (its template puts the document
    # elsewhere). Reused: the other questions and turns, and each completion after its
    # /tokenize twin, each at least the document's tokens.
    after = counts(text)
    assert (after["reused"] - before["reused"], after["whole"] - before["whole"]) == (8, 2)
    doc_tokens = len(engine.tokenizer.encode(doc, add_special_tokens=False))
    assert metric(text, "prompt_token_cache_reused_tokens_total") - tokens_before >= 8 * (doc_tokens - 40)


def test_n_two(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2,
                                  temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, n=2)
    assert len(c.choices) == 2


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The river", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.top_logprobs) == 5 and all(len(t) == 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob == content[0].logprob   # greedy takes the top


def test_completion_top_logprobs_hold_the_sampled_token(client):
    """As OpenAI's completions API: each position's alternatives are the `logprobs`
    likeliest tokens and the sampled one, so up to `logprobs` + 1 entries; with
    `logprobs: 0`, the sampled one alone."""
    r = client.completions.create(model=MODEL, prompt="The river", max_tokens=24, temperature=2.0, seed=7,
                                  logprobs=1)
    lp = r.choices[0].logprobs
    assert all(top[t] == v and 1 <= len(top) <= 2 for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs)   # at temperature 2 some pick is not the likeliest
    r = client.completions.create(model=MODEL, prompt="The river", max_tokens=4, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]


def test_tokenize_and_detokenize(server, front, client, engine):
    """vLLM's /tokenize and /detokenize: the ids the completion and chat endpoints would
    use (the chat one's count is its usage's prompt_tokens), the text back from ids, and
    OpenAI errors for bad bodies."""
    url = server.urls[front]
    text = "The river runs past the mill."
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == list(engine.tokenizer.encode(text)) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == engine.max_model_len
    bare = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False},
                      timeout=60).json()
    assert bare["tokens"] == list(engine.tokenizer.encode(text, add_special_tokens=False))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who keeps the mill?"}]
    chat = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": msgs}, timeout=60).json()
    used = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == used
    assert chat["tokens"] == list(engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                                         tokenize=True))
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": bare["tokens"]}, timeout=60)
    assert back.status_code == 200 and back.json() == {"prompt": engine.tokenizer.decode(bare["tokens"])}
    assert back.json()["prompt"] == text
    for path, body in (("/tokenize", {"model": MODEL}),
                       ("/tokenize", {"model": MODEL, "prompt": "a", "messages": msgs}),
                       ("/tokenize", {"model": MODEL, "prompt": "a", "frobnicate": 1}),
                       ("/detokenize", {"model": MODEL, "tokens": [1, 10**9]}),
                       ("/detokenize", {"model": MODEL, "tokens": "abc"})):
        bad = httpx.post(url + path, json=body, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", (path, body)
    assert httpx.post(url + "/tokenize", json={"model": "gpt-5", "prompt": "a"}, timeout=60).status_code == 404


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no", "unsure"]
    confident: bool
    reasons: list[Literal["data", "taste", "luck"]] = pydantic.Field(max_length=2)


def test_structured_outputs(client, engine):
    """The `openai` client's own structured-output helper gets an instance of its
    pydantic model back; json_object streams JSON; vLLM's `structured_outputs` holds
    completions to choices and a regex. Greedy tokens match the engine's."""
    messages = [{"role": "user", "content": "Is the sky green? Answer in JSON."}]
    r = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Verdict,
                                      max_completion_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Verdict), choice.message.content
    stream = client.chat.completions.create(model=MODEL, messages=messages, response_format={"type": "json_object"},
                                            max_tokens=200, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict), text
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = engine.generate([list(ids)], SamplingParams(temperature=0, max_tokens=200,
                                                       structured_outputs=StructuredOutputsParams(json_object=True)))
    assert text == want[0].outputs[0].text

    colours = ["red", "green", "deep blue"]
    c = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=8, n=4, seed=3,
                                  temperature=1.0, extra_body={"structured_outputs": {"choice": colours}})
    assert all(ch.text in colours and ch.finish_reason == "stop" for ch in c.choices), c.choices
    c = client.completions.create(model=MODEL, prompt="Order number:", max_tokens=12, temperature=0.7, seed=1,
                                  extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{4}"}})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", c.choices[0].text), c.choices[0].text


def test_min_tokens_and_stop_token_ids(client, engine):
    """vLLM's `min_tokens` holds EOS back (here at +100 bias) for that many tokens, and
    `stop_token_ids` ends a completion on a token."""
    eos = next(iter(engine.eos_token_ids))
    prompt = "The baker rose before the sun to"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logit_bias={str(eos): 100},
                                  extra_body={"min_tokens": 4})
    want = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=4,
                                                    logit_bias={eos: 100}))[0].outputs[0]
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"stop_token_ids": [free.token_ids[2]]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == free.token_ids.index(free.token_ids[2]) + 1


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F") and len(args) == 2, args
    return args


def test_named_tool_choice_calls_it_and_streams_its_arguments(client):
    """A named function is called with arguments that follow its schema, on any model
    (here one whose template has no tool format); streamed, the arguments arrive in
    pieces that add up to the same text; the call and its result go back next turn."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named,
                                       temperature=0, max_tokens=60)
    choice = r.choices[0]
    call = choice.message.tool_calls[0]
    assert choice.finish_reason == "stop" and choice.message.content is None and len(choice.message.tool_calls) == 1
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    _weather_args(call.function.arguments)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                                 tool_choice=named, temperature=0, max_tokens=60, stream=True))
    pieces = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and len(pieces) > 2
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"
    turn = ASK + [choice.message,   # handed back as the client returned it, the agent loop's way
                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, clear"}]
    again = client.chat.completions.create(model=MODEL, messages=turn, tools=[WEATHER, CLOCK], tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert again.choices[0].message.tool_calls is None and again.choices[0].message.content


def test_required_tool_choice_and_auto_without_a_tool_format(client):
    """"required" makes one call to one of the tools (parallel_tool_calls off), whole
    or streamed; "auto", the default with tools, is refused where the model's template
    has no tool format that mlx-lm parses."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=80)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    pieces = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == call.function.name and {p.index for p in pieces} == {0}
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments and len(pieces) > 2
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    for choice_kw in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, **choice_kw)
        assert e.value.body["param"] == "tool_choice" and "required" in e.value.body["message"]


def test_auto_tool_calls_parsed_with_mlx_lms_parser(server):
    """A model whose template writes calls between <tool_call> markers (mlx-lm's
    `json_tools` parser): the text it writes (held here to a call by a regex) comes back
    as content and `tool_calls`, whole and streamed, with no marker in the content."""
    client = openai.OpenAI(base_url=server.urls["formats"] + "/v1", api_key="unused", max_retries=0)
    regex = (r'Checking\.<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "(Paris|Oslo)", "unit": "C"\}\}\n</tool_call>')
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=200,
              extra_body={"structured_outputs": {"regex": regex}, "chat_template_kwargs": {"enable_thinking": False}})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and _weather_args(call.function.arguments)["unit"] == "C"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert content == "Checking." and [c.function.arguments for c in calls] == [call.function.arguments]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=6)
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].message.tool_calls is None


def test_strict_tools_under_auto_go_through_the_call_grammar(server):
    """With a strict function under "auto" the formats model's output is held by
    `auto_constraint`'s grammar (its calls are checked token by token in
    test_chat_output.py): it leaves free text free (held to valid UTF-8, which this
    random model's unheld text is not), and a strict function whose parameters
    llguidance cannot hold is a 400 on `tools`, where the same function not strict is
    served as before."""
    client = openai.OpenAI(base_url=server.urls["formats"] + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=12,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    held = client.chat.completions.create(**kw, tools=[strict, CLOCK]).choices[0]
    assert held.message.content and held.message.tool_calls is None and held.finish_reason == "length"
    odd = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, tools=[{"type": "function", "function": {**odd, "strict": True}}])
    assert e.value.body["param"] == "tools" and "nonsense" in e.value.body["message"]
    assert e.value.body["message"].startswith("the tools' parameters") and "\n" not in e.value.body["message"]
    assert client.chat.completions.create(**kw, tools=[{"type": "function", "function": odd}]).choices[0]


def test_auto_tools_beside_a_response_format_and_reasoning(server):
    """Under "auto" a `response_format` no longer rules every call out: the call grammar
    offers the calls or the answer in the format (token by token in
    test_chat_output.py). So a strict function llguidance cannot hold is a 400 on
    `tools` beside a format too (the format alone held the whole output, the tools
    unchecked), and an answer in the format ends the completion. A thinking model may
    reason before its calls: pushed to open its reasoning, it does."""
    url = server.urls["formats"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    def token(text):
        ids = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False})
        assert len(ids.json()["tokens"]) == 1
        return str(ids.json()["tokens"][0])

    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    odd = {"name": "f", "strict": True, "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, tools=[{"type": "function", "function": odd}],
                                       response_format={"type": "json_object"}, extra_body=no_thinking)
    assert e.value.body["param"] == "tools" and "nonsense" in e.value.body["message"]
    empty = {"type": "json_schema", "json_schema": {"name": "empty", "schema": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    answered = client.chat.completions.create(**kw, tools=[WEATHER, CLOCK], response_format=empty,
                                              logit_bias={token("{"): 100}, extra_body=no_thinking).choices[0]
    assert (answered.message.content, answered.message.tool_calls, answered.finish_reason) == ("{}", None, "stop")
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    reasoned = client.chat.completions.create(**kw, tools=[strict, CLOCK], logit_bias={token("<think>"): 100})
    assert getattr(reasoned.choices[0].message, "reasoning", None)


def test_mistrals_calls_under_auto(server):
    """Mistral's format (its markers special tokens, so the text keeps them only because
    "auto" decodes them): pushed to call, the model writes `[TOOL_CALLS]name[ARGS]{...}`
    held by the call grammar to the strict function, which comes back as the call,
    whole and streamed; beside a response format it may answer in the format instead."""
    url = server.urls["mistral"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    ids = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "[TOOL_CALLS]{", "add_special_tokens": False})
    marker, brace = (str(i) for i in ids.json()["tokens"])
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=40, tools=[strict],
              parallel_tool_calls=False, logit_bias={marker: 100})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _weather_args(call.function.arguments)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [c.function.arguments for c in calls] == [call.function.arguments]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    empty = {"type": "json_schema", "json_schema": {"name": "empty", "schema": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    answered = client.chat.completions.create(**{**kw, "tools": [WEATHER, CLOCK], "logit_bias": {brace: 100}},
                                              response_format=empty).choices[0]
    assert (answered.message.content, answered.message.tool_calls, answered.finish_reason) == ("{}", None, "stop")


def test_harmony_turns_come_back_as_reasoning_content_and_calls(server):
    """gpt-oss's harmony format, its markers special tokens: a turn held (by a grammar of
    marker tokens and text) to reasoning then a call comes back as `reasoning` and the
    call, whole and streamed, finish "tool_calls"; the next turn, after the call's
    result, as reasoning and content. A response format holds only the final channel,
    whose JSON is the content; beside a strict tool, the turn is a call held to the
    tool's schema or the answer in the format, and the format is shown to the model in
    its developer message. Responses' output_text logprobs are the answer's tokens alone.
    A forced tool choice, in chat or in the Responses API, holds the text to the calls'
    JSON, read as calls, not as harmony."""
    url = server.urls["harmony"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    names = ("start", "channel", "message", "end", "constrain")
    ids = httpx.post(url + "/tokenize", json={"model": MODEL, "add_special_tokens": False,
                                              "prompt": "".join(f"<|{n}|>" for n in names)}).json()["tokens"]
    m = {n: f"<[{i}]>" for n, i in zip(names, ids)}

    def held(*parts):
        return {"structured_outputs": {"grammar": "start: " + " ".join(parts)}}

    args = '{"city": "Oslo", "unit": "C"}'
    calling = held(m["channel"], '"analysis"', m["message"], '"Weather asked."', m["end"], m["start"], '"assistant"',
                   m["channel"], '"commentary to=functions.get_weather "', m["constrain"], '"json"', m["message"],
                   json.dumps(args))
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=200, tools=[WEATHER, CLOCK])
    choice = client.chat.completions.create(**kw, extra_body=calling).choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.reasoning) == (
        "tool_calls", None, "Weather asked.")
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", args)
    chunks = list(client.chat.completions.create(**kw, extra_body=calling, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Weather asked."
    pieces = [c for d in deltas for c in d.tool_calls or []]   # the arguments stream as written
    assert pieces[0].function.name == "get_weather" and {c.index for c in pieces} == {0}
    assert "".join(c.function.arguments or "" for c in pieces) == args
    assert not any(d.content for d in deltas) and chunks[-1].choices[0].finish_reason == "tool_calls"

    history = ASK + [{"role": "assistant", "content": None, "reasoning": choice.message.reasoning,
                      "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 20 C."}]
    toks = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": history}).json()["tokens"]
    shown = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": toks}).json()["prompt"]
    assert ("<|channel|>analysis<|message|>Weather asked.<|end|><|start|>assistant to=functions.get_weather"
            f"<|channel|>commentary json<|message|>{args}<|call|>") in shown   # the turn goes back as written
    # A call with a preamble beside its reasoning, as the client got it: gpt-oss's template
    # takes one of the two beside calls and refuses both; the reasoning goes back.
    prefaced = [dict(history[1], content="On it."), *history[2:]]
    toks = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": ASK + prefaced})
    assert toks.status_code == 200, toks.text
    shown = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": toks.json()["tokens"]}).json()["prompt"]
    assert "<|channel|>analysis<|message|>Weather asked.<|end|><|start|>assistant to=functions.get_weather" in shown
    answering = held(m["channel"], '"analysis"', m["message"], '"Got it."', m["end"], m["start"], '"assistant"',
                     m["channel"], '"final"', m["message"], '"Sunny in Oslo."')
    answer = client.chat.completions.create(**{**kw, "messages": history}, extra_body=answering).choices[0]
    assert (answer.finish_reason, answer.message.reasoning, answer.message.content, answer.message.tool_calls) == (
        "stop", "Got it.", "Sunny in Oslo.", None)

    # A response format holds the final channel's text, after reasoning if the model
    # reasons (pushed here to answer at once, or to open and close its reasoning first).
    def first(text):
        return str(httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text,
                                                       "add_special_tokens": False}).json()["tokens"][0])

    oslo = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
        "type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}}
    for bias in ({first("final"): 100}, {first("analysis"): 100, str(ids[names.index("end")]): 100}):
        completion = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=200,
                                                    response_format=oslo, logit_bias=bias, logprobs=True)
        formatted = completion.choices[0]
        assert (formatted.finish_reason, formatted.message.content) == ("stop", '{"city": "Oslo"}'), bias
        assert not getattr(formatted.message, "reasoning", None)
        written = "".join(t.token for t in formatted.logprobs.content)   # the framing, then the answer
        assert written.startswith("<|channel|>") and written.endswith('final<|message|>{"city": "Oslo"}'), written
    # The model is shown the format in its developer message, as OpenAI's harmony guide
    # writes it; in the Responses API after the instructions.
    def count(messages):
        return httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages}).json()["count"]

    section = "# Response Formats\n\n## city\n\n" + json.dumps(oslo["json_schema"]["schema"], separators=(",", ":"))
    assert completion.usage.prompt_tokens == count([{"role": "system", "content": section}, *ASK])
    r = client.responses.create(model=MODEL, input=ASK, instructions="Be brief.", temperature=0, max_output_tokens=8,
                                text={"format": {"type": "json_schema", "name": "city", "description": "A city.",
                                                 "schema": oslo["json_schema"]["schema"]}})
    assert r.usage.input_tokens == count([{"role": "system", "content": "Be brief.\n\n" + section.replace(
        "## city\n\n", "## city\n\n// A city.\n")}, *ASK])
    streamed = list(client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=200,
                                                   response_format=oslo, logit_bias=bias, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == '{"city": "Oslo"}'

    # A strict tool beside an answer format, as agent frameworks send them under "auto":
    # a call held to the tool's schema, or the answer in the format.
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    empty = {"type": "json_schema", "json_schema": {"name": "empty", "schema": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    agent = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=200, tools=[strict], response_format=empty)
    answered = client.chat.completions.create(**agent, logit_bias={str(ids[names.index("channel")]): 100,
                                                                   first("final"): 100}).choices[0]
    assert (answered.finish_reason, answered.message.content, answered.message.tool_calls) == ("stop", "{}", None)
    called = client.chat.completions.create(**agent, logit_bias={first(" to=functions"): 100}).choices[0]
    assert called.finish_reason == "tool_calls" and called.message.tool_calls[0].function.name == "get_weather"
    _weather_args(called.message.tool_calls[0].function.arguments)

    # A forced choice holds the text to the calls' JSON, which the tool parser reads.
    forced = client.chat.completions.create(**kw, tool_choice="required").choices[0]
    assert forced.finish_reason == "tool_calls" and forced.message.tool_calls[0].function.name in ("get_weather",
                                                                                                  "get_time")
    r = client.responses.create(model=MODEL, input="Weather in Oslo?", temperature=0, max_output_tokens=200,
                                tools=[{"type": "function", **WEATHER["function"]}],
                                tool_choice={"type": "function", "name": "get_weather"})
    (item,) = r.output
    assert item.type == "function_call" and item.name == "get_weather"
    _weather_args(item.arguments)
    # Responses' output_text logprobs are the answer's tokens alone, none of the framing's.
    kw = dict(model=MODEL, input="Which city?", temperature=0, max_output_tokens=200, top_logprobs=2,
              include=["message.output_text.logprobs"], text={"format": {
                  "type": "json_schema", "name": "city", "schema": oslo["json_schema"]["schema"]}})
    r = client.responses.create(**kw)
    (text,) = [part for item in r.output if item.type == "message" for part in item.content]
    assert text.text == '{"city": "Oslo"}' and "".join(lp.token for lp in text.logprobs) == text.text
    deltas = [e for e in client.responses.create(**kw, stream=True) if e.type == "response.output_text.delta"]
    assert all("".join(lp.token for lp in e.logprobs) == e.delta for e in deltas)
    assert "".join(e.delta for e in deltas) == text.text


def test_an_agent_frameworks_turn_is_served(server):
    """The request the OpenAI Agents SDK (0.24) sends on every turn of an agent with a
    tool and an output type: strict tools made from pydantic models (`$defs` and
    `$ref`s) beside the output type as the response format, over the Responses API and
    over chat. Both are served (the `$ref`s made each a 400), and the answer is a call
    or a message, never both ruled out."""
    client = openai.OpenAI(base_url=server.urls["formats"] + "/v1", api_key="unused", max_retries=0)
    loc = {"properties": {"city": {"title": "City", "type": "string"},
                          "country": {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Country"}},
           "required": ["city", "country"], "title": "Loc", "type": "object", "additionalProperties": False}
    params = {"$defs": {"Loc": loc}, "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
              "title": "get_weather_args", "type": "object", "additionalProperties": False}
    weather = {"properties": {"city": {"title": "City", "type": "string"}, "temp": {"title": "Temp", "type": "integer"}},
               "required": ["city", "temp"], "title": "Weather", "type": "object", "additionalProperties": False}
    tool = {"name": "get_weather", "description": "The weather at a place.", "parameters": params, "strict": True}
    kw = dict(model=MODEL, temperature=0.2)
    r = client.responses.create(**kw, input=[{"role": "user", "content": "Weather in Paris?"}], include=[],
                                instructions="Be brief.", max_output_tokens=16, tools=[{"type": "function", **tool}],
                                text={"format": {"type": "json_schema", "name": "final_output", "schema": weather,
                                                 "strict": True}})
    assert r.output and {o.type for o in r.output} <= {"reasoning", "message", "function_call"}
    c = client.chat.completions.create(**kw, messages=[{"role": "system", "content": "Be brief."}, *ASK], max_tokens=16,
                                       tools=[{"type": "function", "function": tool}],
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "final_output", "schema": weather, "strict": True}})
    assert c.choices[0].message.content or c.choices[0].message.tool_calls


def test_allowed_tools_limit_the_calls_in_chat_and_responses(server):
    """`tool_choice` of type `allowed_tools` ("required" mode here, which any model can
    be held to): both tools reach the template, and every call names the allowed one,
    over chat and over the Responses API (whose form is flat, and which repeats it); a
    name that is not among the tools is a 400."""
    client = openai.OpenAI(base_url=server.urls["formats"] + "/v1", api_key="unused", max_retries=0)
    only_clock = {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}
    chat = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=48, tools=[WEATHER, CLOCK],
                                          tool_choice={"type": "allowed_tools", "allowed_tools": only_clock},
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    calls = chat.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} == {"get_time"}
    flat = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    plain = openai.OpenAI(base_url=server.urls["main"] + "/v1", api_key="unused", max_retries=0)   # no reasoning first
    r = plain.responses.create(model=MODEL, input="What is the weather in Paris?", temperature=0, max_output_tokens=48,
                                tools=[{"type": "function", **t["function"]} for t in (WEATHER, CLOCK)], tool_choice=flat)
    assert {o.name for o in r.output if o.type == "function_call"} == {"get_time"}
    assert r.tool_choice.type == "allowed_tools" and r.tool_choice.mode == "required"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice={
            "type": "allowed_tools", "allowed_tools": {**only_clock, "mode": "auto"}})
    assert "allows 'get_time'" in e.value.body["message"]
    # Under "auto" the call grammar names the allowed tools only: a strict function whose
    # parameters llguidance cannot hold is a 400 when allowed, and no matter when not.
    odd = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}
    kw = dict(model=MODEL, messages=ASK, max_tokens=4, tools=[odd, CLOCK],
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert client.chat.completions.create(**kw, tool_choice={
        "type": "allowed_tools", "allowed_tools": {**only_clock, "mode": "auto"}}).choices[0]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**kw, tool_choice={"type": "allowed_tools", "allowed_tools": {
            "mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}})


def test_reasoning_comes_apart_from_content(server):
    """A thinking model (its vocabulary has "<think>" and "</think>"): what it writes
    between the markers (held here to a shape by a Lark grammar, which names the marker
    tokens) is the message's `reasoning`, the rest its content, whole and streamed;
    `chat_template_kwargs` reach the template: a prompt that opens the reasoning itself,
    and `enable_thinking: false`."""
    client = openai.OpenAI(base_url=server.urls["formats"] + "/v1", api_key="unused", max_retries=0)

    def ask(grammar, **kwargs):
        kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=100,
                  extra_body={"structured_outputs": {"grammar": grammar}, **kwargs})
        message = client.chat.completions.create(**kw).choices[0].message
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        streamed = ("".join(getattr(d, "reasoning", None) or "" for d in deltas),
                    "".join(d.content or "" for d in deltas))
        return getattr(message, "reasoning", None), message.content, streamed

    assert ask('start: <think> "Let me see." </think> "Yes."') == ("Let me see.", "Yes.", ("Let me see.", "Yes."))
    # The answer handed back as the client returned it: its reasoning reaches the template.
    message = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=100,
        extra_body={"structured_outputs": {"grammar": 'start: <think> "Let me see." </think> "Yes."'}},
    ).choices[0].message
    turn = ASK + [message, {"role": "user", "content": "Sure?"}]
    assert client.chat.completions.create(model=MODEL, messages=turn, max_tokens=4).choices[0].message.content is not None
    shown = httpx.post(server.urls["formats"] + "/tokenize", json={
        "model": MODEL, "messages": [*ASK, {"role": "assistant", "content": "Yes.", "reasoning": "Let me see."}]})
    prompt = httpx.post(server.urls["formats"] + "/detokenize", json={
        "model": MODEL, "tokens": shown.json()["tokens"]}).json()["prompt"]
    assert "<think>Let me see.</think>Yes." in prompt
    assert ask('start: "Hmm." </think> "Done."', chat_template_kwargs={"think_open": True}) == \
        ("Hmm.", "Done.", ("Hmm.", "Done."))
    assert ask('start: "Plain."', chat_template_kwargs={"enable_thinking": False}) == (None, "Plain.", ("", "Plain."))
    ids = httpx.post(server.urls["formats"] + "/tokenize", json={
        "model": MODEL, "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    text = httpx.post(server.urls["formats"] + "/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert "<think>\n\n</think>" in text


def test_chat_usage_counts_reasoning_tokens(server):
    """Chat's usage has OpenAI's `completion_tokens_details.reasoning_tokens`: a thinking
    model's tokens up to its end marker, whole and in a stream's usage chunk; a harmony
    turn's up to its first message's end; 0 for an answer without reasoning."""
    def count(url, text):
        return httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text,
                                                   "add_special_tokens": False}).json()["count"]

    def usages(url, grammar):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=100,
                  extra_body={"structured_outputs": {"grammar": grammar}})
        whole = client.chat.completions.create(**kw).usage
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        return whole, chunks[-1].usage

    url = server.urls["formats"]
    for usage in usages(url, 'start: <think> "Let me see." </think> "Yes."'):
        assert usage.completion_tokens_details.reasoning_tokens == count(url, "<think>Let me see.</think>")
        assert usage.completion_tokens == count(url, "<think>Let me see.</think>Yes.")
    for usage in usages(url, 'start: "Plain."'):
        assert usage.completion_tokens_details.reasoning_tokens == 0
    url = server.urls["harmony"]
    names = ("channel", "message", "end")
    ids = httpx.post(url + "/tokenize", json={"model": MODEL, "add_special_tokens": False,
                                              "prompt": "".join(f"<|{n}|>" for n in names)}).json()["tokens"]
    m = {n: f"<[{i}]>" for n, i in zip(names, ids)}
    turn = " ".join([m["channel"], '"analysis"', m["message"], '"Weather asked."', m["end"]])
    for usage in usages(url, f'start: {turn} "x"'):
        assert usage.completion_tokens_details.reasoning_tokens == count(url, "<|channel|>analysis<|message|>"
                                                                              "Weather asked.<|end|>")


def test_echo_with_logprobs_scores_the_prompt(client, engine):
    """`echo` with `logprobs` gives each prompt token's logprob (the first has none), as
    the engine's `prompt_logprobs`; `max_tokens: 0` scores the prompt alone (what
    evaluation harnesses ask); streamed, the opening chunk carries them."""
    prompt = "The baker rose before the sun"
    ids = engine.tokenizer.encode(prompt)
    want = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    want = [w.logprob for w in want.prompt_logprobs[1:]]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == prompt and lp.text_offset[-1] == len(prompt) - len(lp.tokens[-1])
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.text_offset == sorted(lp.text_offset)
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4) and r.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=1,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text == prompt
    assert chunks[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="The river", max_tokens=30, temperature=0)
    text = full.choices[0].text
    stop = "mill"
    assert stop in text
    r = client.completions.create(model=MODEL, prompt="The river", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_seed_reproducible(client):
    kw = dict(model=MODEL, prompt="Hello", max_tokens=16, temperature=1.0, seed=42)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**{**kw, "seed": 7}).choices[0].text
    assert a == b and a != c


def _post(server, path, app, body, headers=None):
    return httpx.post(server.urls[app] + path, json=body, headers=headers, timeout=60)


def _assert_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    return err


def test_error_classes(server, front):
    base = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    r = httpx.post(server.urls[front] + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    _assert_error(r, 400)
    assert _assert_error(_post(server, "/v1/completions", front, {**base, "temperature": "hot"}), 400)["param"] == "temperature"
    _assert_error(_post(server, "/v1/completions", front, {**base, "max_tokens": -3}), 400)
    _assert_error(_post(server, "/v1/completions", front, {**base, "bogus": 1}), 400)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    err = _assert_error(_post(server, "/v1/chat/completions", front, {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": bad_schema}), 400)
    assert err["param"] == "response_format" and "objectx" in err["message"]
    # A content part or input item the server does not take is named, rather than
    # reported as content that is not a string (the first of a union's errors).
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    err = _assert_error(_post(server, "/v1/chat/completions", front, {"model": MODEL, "messages": [image]}), 400)
    assert err["param"] == "messages.content.type" and "'image_url'" in err["message"]
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    err = _assert_error(_post(server, "/v1/responses", front, {"model": MODEL, "input": [image]}), 400)
    assert err["param"] == "input.message.content" and "'input_image'" in err["message"]
    call = {"type": "function_call", "call_id": "c", "name": "f"}
    err = _assert_error(_post(server, "/v1/responses", front, {"model": MODEL, "input": [call]}), 400)
    assert err["param"] == "input.function_call.arguments"
    err = _assert_error(_post(server, "/v1/conversations", front, {"items": [call]}), 400)
    assert err["param"] == "items.function_call.arguments"
    err = _assert_error(_post(server, "/v1/completions", front, {**base, "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found"
    # A check across fields names the field its sentence is about.
    tool = {"type": "function", "function": {"name": "f"}}
    err = _assert_error(_post(server, "/v1/chat/completions", front, {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}), 400)
    assert err["param"] == "tool_choice" and err["message"].startswith("tool_choice names 'g'")
    err = _assert_error(_post(server, "/v1/completions", front, {**base, "stream_options": {"include_usage": True}}),
                        400)
    assert err["param"] == "stream_options"
    err = _assert_error(_post(server, "/v1/responses", front, {"model": MODEL, "input": "hi", "stream": False,
                                                               "stream_options": {}}), 400)
    assert err["param"] == "stream_options"
    err = _assert_error(_post(server, "/v1/completions", front, {**base, "prompt": "word " * 5000}), 400)
    assert err["code"] == "context_length_exceeded" and re.search(r"\d+", err["message"])
    _assert_error(_post(server, "/v1/completions", front, {**base, "prompt": "x" * (70 << 10)}), 413)
    _assert_error(httpx.get(server.urls[front] + "/v1/nothing"), 404)


def test_context_overflow_names_limit_and_numbers(server, front):
    err = _assert_error(_post(server, "/v1/completions", front,
                              {"model": MODEL, "prompt": [5] * 4000, "max_tokens": 500}), 400)
    assert "4096" in err["message"] and "4000" in err["message"] and "500" in err["message"]


def test_api_keys(server, secure):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    _assert_error(_post(server, "/v1/completions", secure, body), 401)
    _assert_error(_post(server, "/v1/completions", secure, body, headers={"Authorization": "Bearer wrong"}), 401)
    ok = _post(server, "/v1/completions", secure, body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    c = openai.OpenAI(base_url=server.urls[secure] + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in c.models.list().data] == [MODEL]


def test_backpressure_gives_503_with_retry_after(server, secure):
    async def one(cl):
        return await cl.post(server.urls[secure] + "/v1/completions",
                             json={"model": MODEL, "prompt": "The river", "max_tokens": 200,
                                   "ignore_eos": True},
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=120)

    async def run():
        async with httpx.AsyncClient() as cl:
            return await asyncio.gather(*(one(cl) for _ in range(8)))

    rs = asyncio.run(run())
    codes = sorted(r.status_code for r in rs)
    assert 200 in codes and 503 in codes, codes
    r503 = next(r for r in rs if r.status_code == 503)
    assert r503.headers.get("retry-after"), r503.text
    _assert_error(r503, 503)


def test_disconnect_mid_stream_frees_blocks(server, front):
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.urls[front] + "/v1/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
            if n >= 5:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(server.urls[front] + "/metrics").text
        if metric(text, "num_requests_running") == 0 and metric(text, "kv_cache_bytes_in_use") == 0:
            break
        time.sleep(0.5)
    assert metric(text, "num_requests_running") == 0
    assert metric(text, "kv_cache_bytes_in_use") == 0


def test_metrics_after_traffic(server, front, client):
    prompt = "The river ran quietly past the old mill, and the miller's daughter counted the boats " * 2
    before = httpx.get(server.urls[front] + "/metrics").text
    took = []
    for stream in (False, True):
        t0 = time.monotonic()
        out = client.completions.create(model=MODEL, prompt=prompt + str(stream), max_tokens=4, temperature=0,
                                        stream=stream)
        if stream:
            list(out)
        took.append(time.monotonic() - t0)
    text = httpx.get(server.urls[front] + "/metrics").text

    def mean(name):
        n = metric(text, name + "_count") - (metric(before, name + "_count") or 0)
        return (metric(text, name + "_sum") - (metric(before, name + "_sum") or 0)) / n
    # Latencies run from the request's arrival: TTFT holds the prefill (a timer started
    # at the first output read about 10 microseconds), and no more than the client saw.
    ttft, e2e = mean("time_to_first_token_seconds"), mean("e2e_request_latency_seconds")
    assert 1e-3 < ttft <= e2e <= max(took)
    # The engine's own part of it: waiting to be scheduled, then the prefill.
    queue, prefill = mean("request_queue_time_seconds"), mean("request_prefill_time_seconds")
    assert 0 <= queue and 0 < prefill and queue + prefill <= ttft
    assert metric(text, "time_to_first_token_seconds_count") > 0
    assert metric(text, "e2e_request_latency_seconds_count") > 0
    assert metric(text, "inter_token_latency_seconds_count") > 0
    assert metric(text, "prefix_cache_hits_total") > 0
    assert metric(text, "prefix_cache_queries_total") >= metric(text, "prefix_cache_hits_total")
    assert metric(text, "generation_tokens_total") > 0
    assert metric(text, "num_preemptions_total") is not None
    assert metric(text, "num_step_failures_total") == 0
    assert metric(text, "kv_cache_usage_perc") is not None
    assert metric(text, "num_requests_waiting") is not None
    assert metric(text, "num_window_slots_in_use") == 0 and metric(text, "window_slot_evictions_total") == 0
    # The engine's steps by duration: the two requests took at least 2 x 4 of them.
    steps = metric(text, "engine_step_duration_seconds_count") - (
        metric(before, "engine_step_duration_seconds_count") or 0)
    assert steps >= 8 and 0 < metric(text, "engine_step_duration_seconds_sum")
    counts = step_time_counts(text)
    assert len(counts) == len(STEP_TIME_BOUNDS_S) + 1 and sum(counts) == metric(
        text, "engine_step_duration_seconds_count")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_server_timing_splits_the_latency_the_client_sees(server, front, path):
    """Streamed: the time to read the request and to the first token, sent with the
    headers, and within the latter the engine's queue and prefill; whole: the request
    and its generation. Within `request`, both ways, `read`: the body fetched from the
    front and parsed, before the prompt is tokenized. Each part is real time and
    together they fit inside what the client measured."""
    url = server.urls[front] + path
    ask = ({"prompt": "Timing the way in and out " * 8} if path == "/v1/completions"
           else {"messages": [{"role": "user", "content": "Timing the way in and out " * 8}]})
    for stream in (True, False):
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": stream, **ask}
        t0 = time.monotonic()
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            got_headers = time.monotonic() - t0
            r.read()
            assert r.status_code == 200, r.text
        took = time.monotonic() - t0
        parts = parse_server_timing(r.headers.get("server-timing", ""))
        engine = {k: parts.pop(k) for k in ENGINE_PARTS if k in parts}
        read = parts.pop("read")
        assert set(parts) == ({"request", "first_token"} if stream else {"request", "generate"})
        assert all(v > 0 for v in parts.values())
        assert 0 < read < parts["request"]
        assert sum(parts.values()) <= got_headers <= took
        if stream:   # the engine's and the way there and back, all within first_token
            assert set(engine) == set(ENGINE_PARTS)
            assert all(v >= 0 for v in engine.values()) and engine["engine_prefill"] > 0
            assert sum(engine.values()) <= parts["first_token"]
        if not stream:
            assert parts["generate"] > 1e-3     # the prefill and 4 decode steps, at least


def test_cached_tokens_in_usage(client):
    prompt = "Question: Who fixed the clock? Answer: A young mechanic fixed the clock. " * 3
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_health(server, front):
    assert httpx.get(server.urls[front] + "/health").json() == {"status": "ok"}


def test_shipped_config_serves_the_default_model():
    """configs/config.yaml as shipped (only the port moved, so a busy 8000 can't fail CI)."""
    import yaml

    from .serving import ROOT

    cfg = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())
    assert cfg["http_options"]["host"] == "127.0.0.1"
    held: set[int] = set()    # serve run's process group, while it runs (what compare.py kills if stuck)
    srv = ServeRun(cfg["applications"], pgids=held)
    try:
        assert held == {srv.proc.pid}
        print(f"configs/config.yaml ready in {srv.startup_s:.1f}s")
        c = openai.OpenAI(base_url=srv.urls["llm"] + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hello!"}],
                                      max_tokens=8)
        assert r.choices[0].message.content and r.usage.completion_tokens > 0
        if Path("/proc/self/task").exists() and os.geteuid() == 0:
            # Ray starts the replica at nice 15; the replica and its engine process, every
            # thread of both (Ray's and MLX's too), are back at nice 0 (`engine_nice: 0`).
            (replica,) = replica_pids("llm")
            (engine,) = engine_pids(replica)
            for pid in (replica, engine):
                tasks = os.listdir(f"/proc/{pid}/task")
                assert {os.getpriority(os.PRIO_PROCESS, int(t)) for t in tasks} == {0}, (pid, tasks)
            # Ray gives its one-CPU replica OMP_NUM_THREADS=1; the engine process gets the host's CPUs.
            env = process_env(engine)
            assert env["OMP_NUM_THREADS"] == str(os.cpu_count()), env.get("OMP_NUM_THREADS")
    finally:
        srv.stop()
    assert held == set()


def _live_haproxy(state_dir: str) -> list[int]:
    return live_pids("-f", f"haproxy.*{state_dir}")


def _haproxy_sessions(state_dir: str) -> dict[str, int]:
    """Sessions HAProxy has sent to each Serve ingress replica, from its admin socket."""
    import socket

    sock_path = next(Path(state_dir).glob("**/admin.sock"))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(sock_path))
        sock.sendall(b"show stat\n")
        data = b"".join(iter(lambda: sock.recv(65536), b""))
    rows = [line.split(",") for line in data.decode().splitlines() if not line.startswith("#")]
    return {r[1]: int(r[7]) for r in rows if len(r) > 7 and r[1].startswith("SERVE_REPLICA")}


@pytest.mark.parametrize("front", ["direct", "haproxy", "grpc"])
def test_shipped_config_under_another_front(front):
    """configs/config.yaml under Ray Serve's direct ingress (the ingress replica answers
    HTTP on its own port), under its HAProxy mode (HAProxy on the HTTP port in front
    of the ingress replica's port; no Python proxy on the request path in either), and
    with its proxy calling the replica over gRPC (README: "Many streams on one host").
    The OpenAI surface is the same: streamed tokens equal the unstreamed answer, a bad
    request is a 400 with an OpenAI error body, and a client that leaves mid-stream
    frees its request (one replica; under HAProxy /metrics may answer from either). Under
    HAProxy the app runs two replicas, HAProxy sends requests to both, and a chain of
    responses (`previous_response_id`) holds across them. HAProxy is Serve's to start
    and to stop: running while served, gone after `serve run`."""
    import yaml

    from .serving import ROOT

    cfg = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())
    if front == "haproxy":
        cfg["applications"][0]["args"]["llm_server"]["num_replicas"] = 2
    srv = ServeRun(cfg["applications"], front=front)
    try:
        if front == "haproxy":
            assert _live_haproxy(srv.dir), srv.tail()
        c = openai.OpenAI(base_url=srv.urls["llm"] + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Name three rivers."}]
        whole = c.chat.completions.create(model="default", messages=msgs, max_tokens=12, temperature=0)
        chunks = list(c.chat.completions.create(model="default", messages=msgs, max_tokens=12,
                                                temperature=0, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == whole.choices[0].message.content and whole.usage.completion_tokens == 12
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="default", messages=msgs, max_tokens=-1)
        assert e.value.body["type"] == "invalid_request_error"
        if front != "haproxy":
            running = lambda: metric(httpx.get(srv.urls["llm"] + "/metrics").text, "num_requests_running")  # noqa: E731
            body = {"model": "default", "prompt": "On and on.", "max_tokens": 4000, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", srv.urls["llm"] + "/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()   # kept: a dropped iterator closes the response
                next(lines)
                assert running() == 1
            deadline = time.monotonic() + 30
            while running() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert running() == 0
        if front == "haproxy":
            deadline = time.monotonic() + 120   # the second replica may still be starting
            while len(_haproxy_sessions(srv.dir)) < 2 and time.monotonic() < deadline:
                time.sleep(1)
            for i in range(4):
                c.completions.create(model="default", prompt=f"Count to {i}.", max_tokens=2)
            sessions = _haproxy_sessions(srv.dir)
            assert len(sessions) == 2 and min(sessions.values()) >= 1, sessions
            # A chain of responses whose turns land on both replicas: each reads the one
            # before from the response store, whichever replica made it.
            c.close()   # no connection left open: HAProxy balances by open connections
            turns, prev = [], None
            for _ in range(4):   # a client a turn: a new connection each time
                with openai.OpenAI(base_url=srv.urls["llm"] + "/v1", api_key="x", max_retries=0) as turn:
                    prev = turn.responses.create(model="default", input="Name a river.", max_output_tokens=4,
                                                 temperature=0, previous_response_id=prev and prev.id)
                turns.append(prev.usage.input_tokens)
            after = _haproxy_sessions(srv.dir)
            assert all(after[k] >= sessions[k] + 1 for k in sessions), (sessions, after)
            assert turns == sorted(set(turns)), turns   # every turn carries all the ones before
    finally:
        srv.stop()
    assert not _live_haproxy(srv.dir)


def test_serve_bench_measures_the_real_server(server):
    """bench/serve_bench.py against this server: every request completes with exactly
    its output length (EOS banned through logit_bias), the prefix workload hits the
    cache, multi-turn sessions carry their history, and the timings are consistent."""
    from mlx_lm.utils import load_tokenizer

    from bench import serve_bench as sb
    from runtime.models import default_model_path

    tok = load_tokenizer(default_model_path())
    src = sb.TextSource(tok, seed=3)
    backend_args = (server.urls["main"], MODEL, sb.eos_logit_bias(tok))

    async def go(reqs, **kw):
        backend = sb.HTTPBackend(*backend_args)
        try:
            return await sb.run(backend, reqs, progress=False, **kw)
        finally:
            await backend.aclose()

    prefix = asyncio.run(go(sb.prefix_workload(src, 8, 64, 2, 8, 6), max_concurrency=2))
    assert prefix["completed"] == 8 and prefix["failed"] == 0
    assert prefix["total_output_tokens"] == 8 * 6
    assert prefix["cached_prompt_tokens"] >= 6 * 48          # 6 of 8 requests find their prefix
    assert prefix["ttft_s"]["p50"] <= prefix["e2el_s"]["p50"]
    assert prefix["tpot_s"]["mean"] > 0 and prefix["itl_s"]["mean"] > 0
    assert 0 < prefix["client_cpu_frac"] < 2               # the client's own CPU share is recorded
    split = {k: d["mean"] for k, d in prefix["server_timing_s"].items()}   # TTFT, from Server-Timing
    engine = {k: split.pop(k) for k in ENGINE_PARTS}     # within first_token
    assert 0 < split.pop("read") < split["request"]      # within request
    assert set(split) == {"request", "first_token", "outside"} and all(v > 0 for v in split.values())
    assert sum(split.values()) == pytest.approx(prefix["ttft_s"]["mean"], rel=1e-6)
    assert all(v >= 0 for v in engine.values()) and 0 < engine["engine_prefill"] <= split["first_token"]

    turns = asyncio.run(go(sb.multi_turn_workload(src, 2, 3, 16, 4), request_rate=20.0))
    assert turns["completed"] == 6 and turns["total_output_tokens"] == 6 * 4
    assert turns["cached_prompt_tokens"] > 0                # later turns resend their history
    assert turns["request_rate"] == 20.0

    async def one(backend, req):
        try:
            return await backend.send(req, None)
        finally:
            await backend.aclose()

    req = sb.random_workload(src, 1, 16, 5, 0.0)[0]
    whole = asyncio.run(one(sb.HTTPBackend(*backend_args, stream=False), req))
    assert whole.ok and whole.output_tokens == 5 and whole.ttft == whole.e2e > 0 and whole.text
    assert set(whole.server_timing) == {"request", "read", "generate"}
    missing = asyncio.run(one(sb.HTTPBackend(backend_args[0], "no-such-model"), req))
    assert not missing.ok and missing.error.startswith("HTTP 404") and "model_not_found" in missing.error


def test_colocated_app_args():
    """`colocate: true` refuses what only the split app has (an ingress deployment, a
    request router); colocated, the engine holds ongoing + queued requests and Serve's
    own limits sit above that, so overload is answered by us with an OpenAI body."""
    import pydantic

    from deployments.app import OVERLOAD_MARGIN, AppArgs, build_app

    with pytest.raises(pydantic.ValidationError, match="no ingress deployment"):
        AppArgs(colocate=True, ingress={"num_replicas": 2})
    router = {"request_router_class": "deployments.router:PrefixAwareRouter"}
    with pytest.raises(pydantic.ValidationError, match="prefix-aware routing"):
        AppArgs(colocate=True, llm_server={"request_router_config": router})
    app = build_app(AppArgs(colocate=True, llm_server={"max_ongoing_requests": 100, "max_queued_requests": 20}))
    d = app._bound_deployment
    assert d.name == "OpenAIServer" and d.init_args[2] == 120
    assert d._deployment_config.max_ongoing_requests == 120 + OVERLOAD_MARGIN
    assert d._deployment_config.max_queued_requests == 120
    unbounded = build_app(AppArgs(colocate=True, llm_server={"max_ongoing_requests": 100}))._bound_deployment
    assert unbounded.init_args[2] is None and unbounded._deployment_config.max_ongoing_requests == 100


def test_replicas_share_their_event_loop_unless_told_not_to():
    """Our handlers run on the loop where Ray receives each replica's requests, in both
    shapes of the app; a config's own `runtime_env.env_vars` win, and
    `share_replica_loop: false` leaves Ray's default."""
    from deployments.app import AppArgs, build_app

    def env(app) -> list[dict]:
        deployments = [app._bound_deployment] + [a._bound_deployment for a in app._bound_deployment.init_args
                                                 if hasattr(a, "_bound_deployment")]
        return [(d.ray_actor_options.get("runtime_env") or {}).get("env_vars", {}) for d in deployments]

    key = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
    assert [e[key] for e in env(build_app(AppArgs(colocate=True)))] == ["0", "0"]   # the app, its response store
    split = build_app(AppArgs(llm_server={"ray_actor_options": {"num_cpus": 1, "runtime_env": {
        "env_vars": {"MY_VAR": "1", key: "1"}}}}, response_store={"enabled": False}))
    assert env(split) == [{key: "0"}, {key: "1", "MY_VAR": "1"}]   # ingress, then LLMServer
    assert env(build_app(AppArgs(colocate=True, share_replica_loop=False))) == [{}, {}]


R_WEATHER = {"type": "function", **WEATHER["function"]}
R_CLOCK = {"type": "function", **CLOCK["function"]}


def test_the_response_store_is_one_replica_both_apps_share():
    """`response_store` makes one `ResponseStore` replica with its bounds, bound into the
    colocated replicas or the ingress; `enabled: false` binds none; bad options are refused."""
    from deployments.app import AppArgs, build_app

    colocated = build_app(AppArgs(colocate=True, response_store={"max_responses": 7, "max_bytes": 1000}))
    split = build_app(AppArgs(response_store={"max_responses": 7, "max_bytes": 1000}))
    for store in (colocated._bound_deployment.init_args[3], split._bound_deployment.init_args[2]):
        d = store._bound_deployment
        assert (d.name, d.num_replicas, d.init_args) == ("ResponseStore", 1, (7, 1000, 30.0))
        assert d.ray_actor_options["num_cpus"] == 0 and d.max_ongoing_requests > 5
    assert build_app(AppArgs(colocate=True, response_store={"enabled": False}))._bound_deployment.init_args[3] is None
    for bad in ({"max_responses": 0}, {"max_bytes": -1}, {"background_lease_s": 1}, {"size": 3}):
        with pytest.raises(pydantic.ValidationError):
            AppArgs(response_store=bad)


def test_chat_completions_made_with_store_are_kept(server, client, front):
    """`store: true` keeps a chat completion, whole or streamed, with its metadata and the
    messages it answered: read back as answered, listed by model and metadata (oldest
    first, paged), given new metadata, its messages listed, deleted. Without `store`
    (OpenAI's default) none is kept."""
    tag = os.urandom(4).hex()   # this run's completions among the module's others
    kw = dict(model=MODEL, temperature=0, max_completion_tokens=6,
              messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    whole = client.chat.completions.create(**kw, store=True, metadata={"run": tag, "kind": "whole"})
    chunks = list(client.chat.completions.create(**kw, store=True, metadata={"run": tag, "kind": "stream"},
                                                 stream=True))
    plain = client.chat.completions.create(**kw)
    got = client.chat.completions.retrieve(whole.id)
    assert got.choices[0].message.content == whole.choices[0].message.content and got.usage == whole.usage
    assert got.model_dump()["metadata"] == {"run": tag, "kind": "whole"}
    streamed = client.chat.completions.retrieve(chunks[0].id)
    assert streamed.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks
                                                          if c.choices) == whole.choices[0].message.content
    assert streamed.choices[0].finish_reason == whole.choices[0].finish_reason
    assert [c.id for c in client.chat.completions.list(metadata={"run": tag}, limit=1)] == [whole.id, streamed.id]
    assert [c.id for c in client.chat.completions.list(metadata={"run": tag}, order="desc")] == [streamed.id, whole.id]
    assert [c.id for c in client.chat.completions.list(metadata={"run": tag, "kind": "stream"})] == [streamed.id]
    assert not client.chat.completions.list(metadata={"run": tag}, model="another").data
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(plain.id)
    said = list(client.chat.completions.messages.list(whole.id, limit=1))
    assert [(m.role, m.content) for m in said] == [("system", "Be brief."), ("user", "Hello there")]
    assert said[0].id != said[1].id
    changed = client.chat.completions.update(whole.id, metadata={"run": tag, "kind": "changed"})
    assert changed.model_dump()["metadata"]["kind"] == "changed" and changed.id == whole.id
    assert [c.id for c in client.chat.completions.list(metadata={"kind": "changed", "run": tag})] == [whole.id]
    assert metric(httpx.get(server.urls[front] + "/metrics", timeout=30).text, "stored_chat_completions") >= 2
    assert client.chat.completions.delete(whole.id).deleted
    for call in (client.chat.completions.retrieve, client.chat.completions.delete,
                 client.chat.completions.messages.list):
        with pytest.raises(openai.NotFoundError):
            call(whole.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, store=True, metadata={f"k{i}": "v" for i in range(17)})
    assert e.value.body["param"] == "metadata"


def test_responses_continue_from_stored_ones(client):
    """A stored response (the default) continues with `previous_response_id`: the same
    answer and input tokens as its items sent whole, streamed too, its instructions not
    carried over; a chain of three; read back, listed item by item, deleted. Each
    stored response holds its whole conversation, so its chain outlives the first."""
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Hello there", temperature=0,
                                    max_output_tokens=6)
    assert first.store is True and first.previous_response_id is None
    then = dict(model=MODEL, input="And again?", temperature=0, max_output_tokens=6)
    chained = client.responses.create(**then, previous_response_id=first.id)
    whole = [{"role": "user", "content": "Hello there"}, *(i.model_dump(exclude_none=True) for i in first.output),
             {"role": "user", "content": "And again?"}]
    sent = client.responses.create(model=MODEL, input=whole, temperature=0, max_output_tokens=6, store=False)
    assert chained.output_text == sent.output_text and chained.usage.input_tokens == sent.usage.input_tokens
    assert chained.previous_response_id == first.id and chained.instructions is None and sent.store is False
    streamed = list(client.responses.create(**then, previous_response_id=first.id, stream=True))[-1].response
    assert streamed.output_text == chained.output_text and streamed.previous_response_id == first.id
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    more = dict(model=MODEL, input="Once more", temperature=0, max_output_tokens=4, previous_response_id=chained.id)
    third = client.responses.create(**more)
    assert third.usage.input_tokens > chained.usage.input_tokens + first.usage.output_tokens

    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    with pytest.raises(openai.BadRequestError) as e:
        list(client.responses.retrieve(first.id, stream=True))
    assert e.value.body["param"] == "stream"
    paged = list(client.responses.input_items.list(chained.id, order="asc", limit=1))   # one item a page
    assert [i.role for i in paged] == ["user", "assistant", "user"]
    assert paged[0].content[0].text == "Hello there" and paged[2].content[0].text == "And again?"
    assert paged[1].id == first.output[0].id and paged[1].content[0].text == first.output_text
    assert [i.id for i in client.responses.input_items.list(chained.id).data] == [i.id for i in paged[::-1]]

    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(sent.id)                  # store: false
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**then, previous_response_id=sent.id)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(first.id)
    assert e.value.body["code"] == "not_cancellable"
    client.responses.delete(first.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.input_items.list,
                 client.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call(first.id)
    assert client.responses.create(**more).output_text == third.output_text


def test_background_responses_run_on_and_can_be_cancelled(server, client, front):
    """`background: true` answers at once, `in_progress`; polled, it ends as the same
    request run in the foreground. Cancelled, it reads `cancelled` for good and its engine
    request is aborted: nothing runs on after it. Only a running one can be cancelled."""
    kw = dict(model=MODEL, input="Hello there", temperature=0, max_output_tokens=12)
    r = client.responses.create(**kw, background=True)
    assert r.background is True and r.status == "in_progress" and r.output == []
    deadline = time.monotonic() + 60
    while r.status == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.1)
        r = client.responses.retrieve(r.id)
    assert r.status in ("completed", "incomplete") and r.background is True
    assert r.output_text == client.responses.create(**kw, store=False).output_text

    story = "Tell me a long story."
    t = time.monotonic()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": story}],
                                          temperature=0, max_completion_tokens=1500)
    whole_s = time.monotonic() - t
    assert chat.choices[0].finish_reason == "length"    # uncancelled, it would run all 1,500 tokens
    long = client.responses.create(model=MODEL, input=story, temperature=0, max_output_tokens=1500, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.id == long.id and cancelled.status == "cancelled"
    url = server.urls[front]
    deadline = time.monotonic() + whole_s / 3    # an abort, not the rest of the 1,500 tokens
    while metric(httpx.get(url + "/metrics").text, "num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(httpx.get(url + "/metrics").text, "num_requests_running") == 0, whole_s
    assert client.responses.retrieve(long.id).status == "cancelled"
    for done in (long.id, r.id):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.cancel(done)
        assert e.value.body["code"] == "not_cancellable"


def test_responses_truncation_auto_drops_the_earliest_turns(client):
    """`truncation: "auto"`: a conversation longer than the context loses its earliest
    turns until it fits, the fewest that must go, and answers as its kept turns sent
    alone; without it, the same conversation is a 400. A chain past the context goes on."""
    long = "alpha beta " * 130        # about 1,000 tokens a turn; the context is 4,096
    turns = []
    for n in range(6):
        turns += [{"role": "user", "content": f"{n} {long}"}, {"role": "assistant", "content": "ok"}]
    turns.append({"role": "user", "content": "last"})
    kw = dict(model=MODEL, temperature=0, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw, input=turns)
    assert e.value.body["code"] == "context_length_exceeded"
    r = client.responses.create(**kw, input=turns, truncation="auto")
    assert r.truncation == "auto" and r.status in ("completed", "incomplete")
    kept = list(client.responses.input_items.list(r.id, order="asc", limit=100))
    cut = len(turns) - len(kept)
    assert 0 < cut and turns[cut]["role"] == "user" and kept[-1].content[0].text == "last"
    assert [i.content[0].text for i in kept] == [t["content"] for t in turns[cut:]]
    alone = client.responses.create(**kw, input=turns[cut:], store=False)
    assert r.output_text == alone.output_text and r.usage.input_tokens == alone.usage.input_tokens
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**kw, input=turns[cut - 2:], store=False)   # one turn more does not fit
    more = client.responses.create(**kw, input=f"7 {long}", previous_response_id=r.id, truncation="auto")
    assert more.previous_response_id == r.id and more.usage.input_tokens < 4096


def test_stored_responses_belong_to_their_api_key(server, secure):
    """Another key neither reads, lists, continues nor deletes a key's response."""
    url = server.urls[secure] + "/v1"
    mine = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    other = openai.OpenAI(base_url=url, api_key="sk-other", max_retries=0)
    r = mine.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    for call in (other.responses.retrieve, other.responses.input_items.list, other.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        other.responses.create(model=MODEL, input="hi", max_output_tokens=2, previous_response_id=r.id)
    assert e.value.body["code"] == "previous_response_not_found"
    assert mine.responses.retrieve(r.id).id == r.id
    assert mine.responses.create(model=MODEL, input="hi", max_output_tokens=2, previous_response_id=r.id).id
    chat = mine.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        max_completion_tokens=2, store=True, metadata={"owner": "mine"})
    for call in (other.chat.completions.retrieve, other.chat.completions.delete,
                 other.chat.completions.messages.list):
        with pytest.raises(openai.NotFoundError):
            call(chat.id)
    assert not other.chat.completions.list(metadata={"owner": "mine"}).data
    assert [c.id for c in mine.chat.completions.list(metadata={"owner": "mine"})][-1] == chat.id
    conv = mine.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
    for call in (other.conversations.retrieve, other.conversations.items.list, other.conversations.delete,
                 lambda c: other.conversations.items.create(c, items=[{"role": "user", "content": "x"}]),
                 lambda c: other.responses.create(model=MODEL, input="hi", max_output_tokens=2, conversation=c)):
        with pytest.raises(openai.NotFoundError):
            call(conv.id)
    assert len(mine.conversations.items.list(conv.id).data) == 1


def test_conversations_hold_the_turns_responses_add(server, client, front):
    """A conversation's items come before a response's input when the response names it,
    as if sent whole (the same text and input tokens), plain and streamed; the response
    adds its input and output to it. Its items are listed, added, read and deleted by
    hand, its metadata updated; deleted, it is a 404 everywhere. `/metrics` counts what
    the store holds."""
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hello there"}],
                                       metadata={"topic": "greeting"})
    assert conv.object == "conversation" and conv.metadata == {"topic": "greeting"}
    assert client.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    r = client.responses.create(model=MODEL, conversation=conv.id, input="And again?", temperature=0,
                                max_output_tokens=6)
    whole = [{"role": "user", "content": "Hello there"}, {"role": "user", "content": "And again?"}]
    sent = client.responses.create(model=MODEL, input=whole, temperature=0, max_output_tokens=6, store=False)
    assert r.output_text == sent.output_text and r.usage.input_tokens == sent.usage.input_tokens
    assert r.conversation.id == conv.id and sent.conversation is None
    items = list(client.conversations.items.list(conv.id, order="asc", limit=1))   # one item a page
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "user"), ("message", "assistant")]
    assert items[1].content[0].text == "And again?" and items[2].id == r.output[0].id

    more = dict(model=MODEL, input="Once more", temperature=0, max_output_tokens=4)
    streamed = list(client.responses.create(**more, conversation={"id": conv.id}, stream=True))[-1].response
    sent = client.responses.create(**{**more, "store": False, "input": [
        *whole, r.output[0].model_dump(exclude_none=True), {"role": "user", "content": "Once more"}]})
    assert streamed.output_text == sent.output_text and streamed.usage.input_tokens == sent.usage.input_tokens
    listed = client.conversations.items.list(conv.id).data      # newest first
    assert len(listed) == 5 and listed[0].id == streamed.output[0].id

    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": "Noted"}]).data
    assert len(added) == 1 and added[0].content[0].text == "Noted"
    got = client.conversations.items.retrieve(added[0].id, conversation_id=conv.id)
    assert got.model_dump() == added[0].model_dump()
    assert client.conversations.items.delete(added[0].id, conversation_id=conv.id).id == conv.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(added[0].id, conversation_id=conv.id)
    assert len(client.conversations.items.list(conv.id).data) == 5
    assert client.conversations.update(conv.id, metadata={"topic": "farewell"}).metadata == {"topic": "farewell"}
    text = httpx.get(server.urls[front] + "/metrics", timeout=30).text
    assert metric(text, "stored_conversations") >= 1 and metric(text, "stored_conversation_bytes") > 0
    assert metric(text, "stored_responses") >= 2 and metric(text, "stored_response_bytes") > 0

    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**more, conversation=conv.id, previous_response_id=r.id)
    assert "mutually exclusive" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.create(metadata={f"k{i}": "v" for i in range(17)})
    assert e.value.body["param"] == "metadata"
    assert client.conversations.delete(conv.id).deleted
    for call in (client.conversations.retrieve, client.conversations.delete, client.conversations.items.list,
                 lambda c: client.responses.create(**more, conversation=c)):
        with pytest.raises(openai.NotFoundError):
            call(conv.id)


def test_without_a_store_nothing_is_kept(server):
    """`response_store: {enabled: false}`: every response is as with `store: false`, a
    `previous_response_id` is a 400 and the routes by id a 404, each saying so."""
    c = openai.OpenAI(base_url=server.urls["mistral"] + "/v1", api_key="unused", max_retries=0)
    r = c.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert r.store is False
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve(r.id)
    assert "stores no responses or chat completions" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        c.conversations.create()
    assert "keeps no conversations" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.list()
    assert "stores no responses or chat completions" in e.value.body["message"]
    assert metric(httpx.get(server.urls["mistral"] + "/metrics", timeout=30).text, "stored_responses") is None
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="hi", max_output_tokens=2, previous_response_id=r.id)
    assert "stores no responses" in e.value.body["message"] and e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="hi", max_output_tokens=2, background=True)
    assert e.value.body["param"] == "background"


def test_responses_answers_as_chat_does(client):
    """`/v1/responses` is the chat pipeline: the same text, usage and stop as the chat
    completion of the same messages (instructions as the system message), whole and
    streamed; the stream is the event sequence the `openai` client's helper accepts."""
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        temperature=0, max_completion_tokens=12)
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Hello there", temperature=0,
                                max_output_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    events = list(client.responses.create(model=MODEL, instructions="Be brief.", input="Hello there",
                                          temperature=0, max_output_tokens=12, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{r.status}"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    last = events[-1].response
    assert last.id == events[0].response.id and last.output_text == r.output_text
    assert last.usage.output_tokens == r.usage.output_tokens and last.status == r.status


def test_responses_logprobs_are_the_chat_completions(server, client):
    """With `include: ["message.output_text.logprobs"]`, output_text carries the logprobs
    the chat completion of the same request gives, with `top_logprobs` alternatives,
    whole and in the stream's deltas; without it none, as OpenAI's API answers. On the
    thinking model the tokens spell the text (which of them are reasoning:
    test_responses.py)."""
    def triples(lps):
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in lps]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                          temperature=0, max_completion_tokens=8, logprobs=True, top_logprobs=2)
    want = triples(chat.choices[0].logprobs.content)
    assert len(want) == 8 and all(len(top) == 2 for _, _, top in want)
    kw = dict(model=MODEL, input="Hello there", temperature=0, max_output_tokens=8)
    r = client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=2)
    assert triples(r.output[0].content[0].logprobs) == want
    events = list(client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=2,
                                          stream=True))
    assert triples(lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs) == want
    assert triples(events[-1].response.output[0].content[0].logprobs) == want
    assert client.responses.create(**kw, top_logprobs=2).output[0].content[0].logprobs == []

    thinking = openai.OpenAI(base_url=server.urls["formats"] + "/v1", api_key="unused", max_retries=0)
    for stream in (False, True):
        r = thinking.responses.create(model=MODEL, input="Weather?", temperature=0, max_output_tokens=40,
                                      include=["message.output_text.logprobs"], stream=stream)
        if stream:
            r = list(r)[-1].response
        [message] = [i for i in r.output if i.type == "message"]
        text = "".join(t.token for t in message.content[0].logprobs)
        assert text.startswith(r.output_text) and "</think>" not in text, (r.output, text)


def test_logprobs_bytes_rebuild_characters_split_across_tokens(client):
    """Each logprob entry's `bytes` are its token's own UTF-8 bytes, as OpenAI's are, so
    joined they rebuild the text where a character spans several tokens (each decoded
    alone is U+FFFD): in chat, whole and streamed, and in Responses' output_text, whose
    every delta carries the entries of its own text."""
    word = "café ☃ 世界"
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say it."}], max_tokens=40, temperature=0,
              logprobs=True, top_logprobs=1, extra_body={"structured_outputs": {"choice": [word]}})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == word and any(t.token == "\ufffd" for t in content)
    assert bytes(b for t in content for b in t.bytes).decode() == word
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in content]

    schema = {"type": "object", "properties": {"w": {"enum": [word]}}, "required": ["w"],
              "additionalProperties": False}
    events = list(client.responses.create(model=MODEL, input="Say it.", temperature=0, max_output_tokens=60,
                                          text={"format": {"type": "json_schema", "name": "w", "schema": schema}},
                                          include=["message.output_text.logprobs"], stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert json.loads("".join(e.delta for e in deltas)) == {"w": word}
    for e in deltas:
        assert bytes(b for lp in e.logprobs for b in lp.bytes).decode() == e.delta


def test_responses_structured_output_and_conversation_items(client):
    """`text.format` holds the text to a schema (the client's `responses.parse`), and a
    conversation handed back as items, the assistant's message among them, is the chat
    conversation of the same turns."""
    class Answer(pydantic.BaseModel):
        mood: Literal["glad", "sad"]
        count: int = pydantic.Field(ge=0, le=99)

    r = client.responses.parse(model=MODEL, input="How do you feel?", text_format=Answer, temperature=0,
                               max_output_tokens=40)
    assert isinstance(r.output_parsed, Answer) and r.status == "completed"
    with client.responses.stream(model=MODEL, input="How do you feel?", text_format=Answer, temperature=0,
                                 max_output_tokens=40) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == r.output_parsed
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Again"}]
    chat = client.chat.completions.create(model=MODEL, messages=turns, temperature=0, max_completion_tokens=6)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
             {"role": "user", "content": "Again"}]
    r = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=6)
    assert r.output_text == chat.choices[0].message.content
    # Errors name the fields the client sent.
    bad_schema = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}
    for kw, param in (({"text": bad_schema}, "text"), ({"max_output_tokens": 10**9}, "max_output_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="hi", **kw)
        assert e.value.body["param"] == param, e.value.body


def test_responses_function_calls_round_trip(client):
    """A named function is called with arguments of its schema; streamed, the arguments
    come in pieces that add up to them; the call and its output, handed back as items,
    make the chat conversation of a call and its tool message."""
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[R_WEATHER, R_CLOCK],
                                tool_choice=named, temperature=0, max_output_tokens=60)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    _weather_args(call.arguments)
    assert r.tool_choice.name == "get_weather" and [t.name for t in r.tools] == ["get_weather", "get_time"]
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[R_WEATHER, R_CLOCK],
                                 tool_choice=named, temperature=0, max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 2 and "".join(pieces) == call.arguments and final.output[0].arguments == call.arguments
    items = [{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, clear"}]
    again = client.responses.create(model=MODEL, input=items, tools=[R_WEATHER], tool_choice="none", temperature=0,
                                    max_output_tokens=8)
    chat = client.chat.completions.create(
        model=MODEL, tools=[WEATHER], tool_choice="none", temperature=0, max_completion_tokens=8,
        messages=ASK + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, clear"}])
    assert again.output_text == chat.choices[0].message.content and again.output[0].type == "message"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, clear"}
    chained = client.responses.create(model=MODEL, input=[output], previous_response_id=r.id, tools=[R_WEATHER],
                                      tool_choice="none", temperature=0, max_output_tokens=8)
    assert chained.output_text == again.output_text
