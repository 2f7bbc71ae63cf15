"""Reliability and security under load, faults and bad input, against a real `serve run`.

Every loop is bounded in count and time, and all traffic goes to 127.0.0.1.
"""

import asyncio
import json
import os
import random
import signal
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import EngineConfig, LLMEngine, SamplingParams

from .serving import ServeRun, app, engine_pids, exited, live_pids, metric, replica_pids

MODEL = "default"
KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
BODY_LIMIT = 32 << 10
STALL_S = 10.0   # engine_stall_timeout_s of the apps whose engines these tests stop
LEASE_S = 3.0    # response_store.background_lease_s of the "rel" app


@pytest.fixture(scope="module")
def server():
    small = {"num_cpus": 0.4}
    srv = ServeRun([
        app("rel", "/", served_model_name=MODEL, max_request_body_bytes=BODY_LIMIT,
            engine={"max_num_seqs": 32, "kv_cache_memory_bytes": 64 << 20}, engine_stall_timeout_s=STALL_S,
            llm_server={"ray_actor_options": small, "max_ongoing_requests": 256,
                        "health_check_period_s": 2.0, "health_check_timeout_s": 10.0},
            ingress={"ray_actor_options": {"num_cpus": 0.1}}, response_store={"background_lease_s": LEASE_S}),
        app("tiny", "/tiny", served_model_name=MODEL,
            engine={"num_gpu_blocks": 20, "block_size": 16, "max_num_seqs": 16},
            llm_server={"ray_actor_options": small}, ingress={"ray_actor_options": {"num_cpus": 0.1}}),
        app("sec", "/sec", served_model_name=MODEL, api_keys=[KEY_A, KEY_B],
            engine={"kv_cache_memory_bytes": 16 << 20},
            llm_server={"ray_actor_options": small}, ingress={"ray_actor_options": {"num_cpus": 0.1}}),
        app("colo", "/colo", served_model_name=MODEL, colocate=True,
            engine={"max_num_seqs": 32, "kv_cache_memory_bytes": 64 << 20}, engine_stall_timeout_s=STALL_S,
            llm_server={"ray_actor_options": small, "max_ongoing_requests": 256,
                        "health_check_period_s": 2.0, "health_check_timeout_s": 10.0}),
    ])
    yield srv
    srv.stop()


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def wait_idle(url: str, timeout: float = 60.0) -> str:
    """Poll until no request runs, waits or holds a KV block; returns the metrics text."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(url)
        idle = (metric(text, "num_requests_running") == 0 and metric(text, "num_requests_waiting") == 0
                and metric(text, "kv_cache_bytes_in_use") == 0)
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


# -- bad input -------------------------------------------------------------------
C, CH, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESP = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD_INPUTS = [
    ("invalid json", C, b"{\"model\": ", 400),
    ("json array body", C, [1, 2, 3], 400),
    ("json string body", C, "hello", 400),
    ("empty body", C, b"", 400),
    ("missing model", C, {"prompt": "hi"}, 400),
    ("missing prompt", C, {"model": MODEL}, 400),
    ("unknown model", C, {**OK, "model": "gpt-5"}, 404),
    ("unknown field", C, {**OK, "frobnicate": True}, 400),
    ("prompt wrong type", C, {**OK, "prompt": 12}, 400),
    ("prompt empty list", C, {**OK, "prompt": []}, 400),
    ("prompt empty string", C, {**OK, "prompt": ""}, 400),
    ("max_tokens negative", C, {**OK, "max_tokens": -1}, 400),
    ("max_tokens zero without echo", C, {**OK, "max_tokens": 0}, 400),
    ("max_tokens zero streamed", C, {**OK, "max_tokens": 0, "echo": True, "stream": True}, 400),
    ("max_tokens huge", C, {**OK, "max_tokens": 10**9}, 400),
    ("max_tokens string", C, {**OK, "max_tokens": "ten"}, 400),
    ("n zero", C, {**OK, "n": 0}, 400),
    ("n huge", C, {**OK, "n": 100000}, 400),
    ("temperature negative", C, {**OK, "temperature": -0.5}, 400),
    ("temperature too high", C, {**OK, "temperature": 7}, 400),
    ("top_p above one", C, {**OK, "top_p": 1.5}, 400),
    ("top_p zero", C, {**OK, "top_p": 0}, 400),
    ("top_k below -1", C, {**OK, "top_k": -5}, 400),
    ("logprobs above 20", C, {**OK, "logprobs": 21}, 400),
    ("presence penalty out of range", C, {**OK, "presence_penalty": 3}, 400),
    ("token id out of vocabulary", C, {**OK, "prompt": [1, 2, 999999]}, 400),
    ("negative token id", C, {**OK, "prompt": [-3]}, 400),
    ("bad logit_bias key", C, {**OK, "logit_bias": {"abc": 1}}, 400),
    ("logit_bias key out of vocabulary", C, {**OK, "logit_bias": {"999999": 1}}, 400),
    ("logit_bias value out of range", C, {**OK, "logit_bias": {"5": 1000}}, 400),
    ("stop list too long", C, {**OK, "stop": [f"s{i}" for i in range(40)]}, 400),
    ("empty stop string", C, {**OK, "stop": [""]}, 400),
    ("prompt over context", C, {**OK, "prompt": [5] * 5000}, 400),
    ("body over size limit", C, {**OK, "prompt": "y" * (BODY_LIMIT + 10)}, 413),
    ("suffix unsupported", C, {**OK, "suffix": "end"}, 400),
    ("min_tokens above max_tokens", C, {**OK, "max_tokens": 4, "min_tokens": 5}, 400),
    ("min_tokens negative", C, {**OK, "min_tokens": -1}, 400),
    ("stop_token_ids out of vocabulary", C, {**OK, "stop_token_ids": [999999]}, 400),
    ("stream_options without stream", C, {**OK, "stream_options": {"include_usage": True}}, 400),
    ("empty messages", CH, {"model": MODEL, "messages": []}, 400),
    ("unknown role", CH, {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("image content part", CH, {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400),
    ("message without role", CH, {**CHAT, "messages": [{"content": "hi"}]}, 400),
    ("response_format unknown type", CH, {**CHAT, "response_format": {"type": "xml"}}, 400),
    ("json_schema not a schema", CH, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, 400),
    ("json_schema type without json_schema", CH, {**CHAT, "response_format": {"type": "json_schema"}}, 400),
    ("structured_outputs bad regex", C, {**OK, "structured_outputs": {"regex": "[a-"}}, 400),
    ("structured_outputs two constraints", C, {**OK, "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400),
    ("response_format and structured_outputs", CH, {**CHAT, "response_format": {"type": "json_object"},
                                                     "structured_outputs": {"regex": "a"}}, 400),
    ("top_logprobs without logprobs", CH, {**CHAT, "top_logprobs": 3}, 400),
    ("top_logprobs above 20", CH, {**CHAT, "logprobs": True, "top_logprobs": 50}, 400),
    ("max_completion_tokens negative", CH, {**CHAT, "max_completion_tokens": -2}, 400),
    ("tool without function", CH, {**CHAT, "tools": [{"type": "function"}], "tool_choice": "required"}, 400),
    ("tool_choice without tools", CH, {**CHAT, "tool_choice": "required"}, 400),
    ("tool_choice names no tool", CH, {**CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}, 400),
    ("tool parameters not a schema", CH, {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objectx"}}}], "tool_choice": "required"}, 400),
    ("tool parameters not an object", CH, {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}], "tool_choice": "required"}, 400),
    ("auto tools on a model without a tool format", CH, {**CHAT, "tools": [TOOL]}, 400),
    ("user message with null content", CH, {**CHAT, "messages": [{"role": "user", "content": None}]}, 400),
    ("tool message without tool_call_id", CH, {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400),
    ("legacy function_call in a message", CH, {**CHAT, "messages": [{"role": "assistant", "content": "x",
        "function_call": {"name": "f", "arguments": "{}"}}]}, 400),
    ("reasoning on a user message", CH, {**CHAT, "messages": [{"role": "user", "content": "x", "reasoning": "y"}]},
     400),
    ("chat_template_kwargs sets tokenize", CH, {**CHAT, "chat_template_kwargs": {"tokenize": False}}, 400),
    ("tool call arguments not JSON", CH, {**CHAT, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400),
    ("responses: previous_response_id", R, {**RESP, "previous_response_id": "resp_1"}, 400),
    ("responses: empty input", R, {**RESP, "input": []}, 400),
    ("responses: input image", R, {**RESP, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, 400),
    ("responses: built-in tool", R, {**RESP, "tools": [{"type": "web_search"}]}, 400),
    ("responses: json_schema without schema", R, {**RESP, "text": {"format": {"type": "json_schema", "name": "x"}}},
     400),
    ("responses: schema not a schema", R, {**RESP, "text": {"format": {"type": "json_schema", "name": "x",
                                                                     "schema": {"type": "objectx"}}}}, 400),
    ("responses: tool_choice names no tool", R, {**RESP, "tools": [{"type": "function", "name": "f"}],
                                                 "tool_choice": {"type": "function", "name": "g"}}, 400),
    ("responses: max_output_tokens huge", R, {**RESP, "max_output_tokens": 10**9}, 400),
    ("responses: unknown field", R, {**RESP, "frobnicate": 1}, 400),
]


def _send(url: str, path: str, body, headers=None):
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json", **(headers or {})},
                          timeout=60)
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def _is_openai_error(r) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err.get("message"), str) and err["message"] and "type" in err \
        and "param" in err and "code" in err and "Traceback" not in r.text


def test_bad_input_table(server):
    url = server.urls["rel"]
    assert len(BAD_INPUTS) >= 30
    failures = []
    for name, path, body, status in BAD_INPUTS:
        r = _send(url, path, body)
        if r.status_code != status or not _is_openai_error(r):
            failures.append((name, r.status_code, r.text[:200]))
        # nothing a bad request does breaks the next good one
        ok = _send(url, C, OK)
        assert ok.status_code == 200, (name, ok.text)
    assert not failures, failures
    print(f"bad inputs tried: {len(BAD_INPUTS)}, all answered with the right 4xx")


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                         st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=20))
fields = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.just(MODEL), json_scalars),
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 600), max_size=8), json_scalars),
    "max_tokens": st.one_of(st.integers(-3, 6), json_scalars),
    "temperature": st.one_of(st.floats(-1, 3), json_scalars),
    "top_p": st.one_of(st.floats(-0.5, 1.5), json_scalars),
    "top_k": st.one_of(st.integers(-3, 50), json_scalars),
    "n": st.one_of(st.integers(-1, 3), json_scalars),
    "logprobs": st.one_of(st.integers(-1, 25), json_scalars),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=4), max_size=20), json_scalars),
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=6), st.floats(-200, 200), max_size=3), json_scalars),
    "stream": st.booleans(),
    "seed": st.one_of(st.integers(-10, 10**9), json_scalars),
    "structured_outputs": st.one_of(st.fixed_dictionaries({}, optional={
        "regex": st.one_of(st.text(max_size=8), json_scalars),
        "choice": st.one_of(st.lists(st.text(max_size=4), max_size=3), json_scalars),
        "grammar": st.one_of(st.text(max_size=12), json_scalars),
        "json": st.one_of(st.dictionaries(st.sampled_from(["type", "enum", "items", "x"]), json_scalars,
                                          max_size=2), json_scalars),
        "json_object": st.booleans(),
    }), json_scalars),
})
bodies = st.tuples(fields, st.dictionaries(st.text(min_size=1, max_size=8), json_scalars, max_size=2)) \
    .map(lambda t: {**t[1], **t[0]})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_fuzz_completion_schema(server, body):
    """Any JSON object gets a 200 or a well-formed 4xx, never a 5xx or a stack trace."""
    r = httpx.post(server.urls["rel"] + C, json=body, timeout=60)
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert _is_openai_error(r), r.text


text_parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                             "text": st.one_of(st.text(max_size=8), json_scalars)}), max_size=2)
items = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
                           "content": st.one_of(st.text(max_size=12), text_parts)},
                          optional={"type": st.sampled_from(["message", "reasoning"])}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=6),
                           "name": st.one_of(st.sampled_from(["f", "g"]), json_scalars),
                           "arguments": st.one_of(st.sampled_from(["{}", '{"a": 1}', "{oops", ""]), json_scalars)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=6),
                           "output": st.one_of(st.text(max_size=8), json_scalars)}),
    json_scalars)
# The model and input are mostly well-formed, so that most bodies reach the translation.
response_fields = st.fixed_dictionaries({
    "model": st.just(MODEL),
    "input": st.one_of(st.text(min_size=1, max_size=40), st.lists(items, min_size=1, max_size=4)),
}, optional={
    "instructions": st.one_of(st.text(max_size=10), json_scalars),
    "max_output_tokens": st.one_of(st.integers(-3, 6), json_scalars),
    "temperature": st.one_of(st.floats(-1, 3), json_scalars),
    "stream": st.booleans(),
    "tools": st.one_of(st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                                       "name": st.sampled_from(["f", "g"])},
                                                      optional={"parameters": st.one_of(st.just({"type": "object"}),
                                                                                        json_scalars)}),
                                max_size=2), json_scalars),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                             st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "h"])}),
                             json_scalars),
    "text": st.one_of(st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
        optional={"name": st.text(max_size=4), "schema": st.one_of(st.just({"type": "object"}), json_scalars)})}),
        json_scalars),
    "previous_response_id": st.one_of(st.none(), st.text(max_size=6)),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=response_fields)
def test_fuzz_responses_schema(server, body):
    """The same for `/v1/responses`, whose items become chat messages; a stream that
    answers 200 carries no error event."""
    r = httpx.post(server.urls["rel"] + R, json={**body, "max_output_tokens": body.get("max_output_tokens", 4)},
                   timeout=60)
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert _is_openai_error(r), r.text
    else:
        assert "event: error" not in r.text and "Traceback" not in r.text


# -- security ---------------------------------------------------------------------
def test_tenants_never_share_prefix_blocks(server):
    url = server.urls["sec"]
    prompt = "The river ran quietly past the old mill, and the miller's daughter counted " * 3
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}

    def cached(key, extra=None):
        r = _send(url, C, {**body, **(extra or {})}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(KEY_A)
    assert cached(KEY_A) > 0                      # a tenant hits its own blocks
    assert cached(KEY_B) == 0                     # never the other tenant's
    # a client-sent salt does not open another tenant's cache
    from deployments.ingress import tenant_salt
    assert cached(KEY_B, {"cache_salt": tenant_salt(KEY_A)}) == 0
    assert cached(KEY_B) > 0


def test_prompts_are_not_logged(server):
    marker = "zebra-marker-7781"
    r = _send(server.urls["rel"], C, {**OK, "prompt": f"{marker} hello"})
    assert r.status_code == 200
    time.sleep(1.0)
    assert marker not in server.tail(10**7)


# -- KV exhaustion ---------------------------------------------------------------------
def test_kv_exhaustion_preempts_and_completes(server, default_model):
    """20 blocks of 16 tokens, 12 concurrent requests of ~100 tokens each: far more than
    fits. Every request completes through preemption, with its greedy tokens alone."""
    url = server.urls["tiny"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(30, 60))] for _ in range(12)]
    before = metric(metrics(url), "num_preemptions_total") or 0

    async def one(cl, p):
        r = await cl.post(url + C, json={"model": MODEL, "prompt": p, "max_tokens": 48, "temperature": 0,
                                          "ignore_eos": True}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def run():
        async with httpx.AsyncClient() as cl:
            return await asyncio.gather(*(one(cl, p) for p in prompts))

    texts = asyncio.run(run())
    engine = LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=64))
    for p, text in zip(prompts, texts):
        alone = engine.generate([p], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0]
        assert text == alone.outputs[0].text
    text = wait_idle(url)
    preemptions = metric(text, "num_preemptions_total") - before
    print(f"KV exhaustion: 12 requests on 20 blocks, {preemptions:.0f} preemptions, all completed")
    assert preemptions > 0
    assert metric(text, "kv_cache_bytes_in_use") == 0


# -- soak ---------------------------------------------------------------------------
def test_soak_with_disconnects(server):
    url = server.urls["rel"]
    wait_idle(url)
    warm = metric(metrics(url), "device_memory_active_bytes")
    rng = random.Random(1234)
    n_requests, concurrency = 1000, 24
    plan = []
    for i in range(n_requests):
        plan.append({
            "stream": rng.random() < 0.5,
            "max_tokens": rng.randrange(1, 24),
            "prompt": " ".join(rng.choice(["river", "mill", "boat", "bread", "clock", "star"])
                               for _ in range(rng.randrange(1, 40))),
            "disconnect_after": rng.randrange(1, 6) if rng.random() < 0.2 else None,
        })
    counts = {"completed": 0, "disconnected": 0, "bad_finish": 0, "errors": 0}

    async def one(cl, spec):
        body = {"model": MODEL, "prompt": spec["prompt"], "max_tokens": spec["max_tokens"],
                "stream": spec["stream"], "ignore_eos": True, "temperature": 0.7}
        if spec["disconnect_after"] is not None:
            # a client that goes away mid-request: a stream closed after a few chunks
            body.update(stream=True, max_tokens=200)
            async with cl.stream("POST", url + C, json=body, timeout=60) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= spec["disconnect_after"]:
                        break
            counts["disconnected"] += 1
            return
        if spec["stream"]:
            reasons, ntok = [], 0
            async with cl.stream("POST", url + C, json=body, timeout=120) as r:
                if r.status_code != 200:
                    counts["errors"] += 1
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            counts["errors"] += 1
                            return
                        for c in ev["choices"]:
                            ntok += 1
                            if c["finish_reason"]:
                                reasons.append(c["finish_reason"])
            ok = reasons == ["length"]
        else:
            r = await cl.post(url + C, json=body, timeout=120)
            if r.status_code != 200:
                counts["errors"] += 1
                return
            data = r.json()
            ok = data["choices"][0]["finish_reason"] == "length" \
                and data["usage"]["completion_tokens"] == spec["max_tokens"]
        counts["completed" if ok else "bad_finish"] += 1

    async def run():
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency * 2)
        async with httpx.AsyncClient(limits=limits) as cl:
            async def guarded(spec):
                async with sem:
                    await one(cl, spec)
            await asyncio.wait_for(asyncio.gather(*(guarded(s) for s in plan)), timeout=900)

    t0 = time.monotonic()
    asyncio.run(run())
    wall = time.monotonic() - t0
    text = wait_idle(url)
    after = metric(text, "device_memory_active_bytes")
    growth = after - warm
    print(f"soak: {n_requests} requests in {wall:.0f}s, {counts['completed']} completed, "
          f"{counts['disconnected']} disconnected, {counts['bad_finish']} wrong finish, "
          f"{counts['errors']} errors; KV bytes held after {metric(text, 'kv_cache_bytes_in_use'):.0f}; "
          f"MLX memory {warm / 2**20:.1f} MiB after warm-up, {after / 2**20:.1f} MiB after soak")
    assert counts["errors"] == 0 and counts["bad_finish"] == 0
    assert counts["completed"] + counts["disconnected"] == n_requests
    assert metric(text, "num_requests_running") == 0 and metric(text, "num_requests_waiting") == 0
    assert metric(text, "kv_cache_bytes_in_use") == 0                 # blocks leaked: 0
    assert growth <= 64 << 20, f"engine memory grew by {growth / 2**20:.1f} MiB"


# -- process failures (last: they kill processes) ------------------------------------------
def _wait_served(url: str, app_name: str, old_replicas: list[int], timeout: float = 120) -> httpx.Response:
    """Polls until a replica other than `old_replicas` answers; returns its answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = replica_pids(app_name)
        if new and not set(new) & set(old_replicas):
            try:
                r = _send(url, C, OK)
                if r.status_code == 200:
                    return r
            except httpx.HTTPError:
                pass
        time.sleep(1)
    return _send(url, C, OK)


def _app_processes(server, app_name: str) -> tuple[str, list[int], list[int]]:
    """The app's URL, its LLMServer replicas' pids and their engine processes' pids."""
    pids = replica_pids(app_name)
    engines = [e for p in pids for e in engine_pids(p)]
    assert engines, "no engine process found"
    return server.urls[app_name], pids, engines


async def _signal_under_load(victims: list[int], requests: list, sig=signal.SIGKILL) -> list:
    """Starts `requests` (coroutines), sends `sig` to `victims` 1.5 s in, returns the outcomes."""
    tasks = [asyncio.create_task(r) for r in requests]
    await asyncio.sleep(1.5)
    for p in victims:
        os.kill(p, sig)
    return await asyncio.gather(*tasks)


@pytest.mark.parametrize("app_name", ["rel", "colo"])
def test_engine_death_is_503_and_the_replica_is_replaced(server, app_name):
    """An engine process that dies (here SIGKILL) fails the requests it held and every
    new one with 503 + Retry-After and an OpenAI error body, never a 500 or a hang; the
    replica's health check then fails and Serve replaces it. Split and colocated."""
    url, pids, engines = _app_processes(server, app_name)

    async def run():
        async with httpx.AsyncClient() as cl:
            held = await _signal_under_load(engines, [
                cl.post(url + C, json={"model": MODEL, "prompt": f"tale {i}", "max_tokens": 400,
                                       "ignore_eos": True}, timeout=90) for i in range(4)])
            after = await cl.post(url + C, json=OK, timeout=30)
            return held, after

    held, after = asyncio.run(run())
    print(f"engine killed mid-load: {[r.status_code for r in held]}, then {after.status_code}")
    for r in [*held, after]:
        assert r.status_code in (200, 503), r.text      # a request may finish before the kill
    failed = [r for r in [*held, after] if r.status_code == 503]
    assert failed, "no request saw the dead engine"
    for r in failed:
        assert r.headers["retry-after"] and r.json()["error"]["type"] == "server_error"
    r = _wait_served(url, app_name, pids)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("app_name", ["rel", "colo"])
def test_a_stalled_engine_is_503_and_the_replica_is_replaced(server, app_name):
    """An engine process that stops stepping without dying (here SIGSTOP: a hung device
    or a deadlock looks the same from outside) fails its held requests once the health
    check finds it quiet past `engine_stall_timeout_s`, instead of holding them forever;
    it is killed, and Serve replaces the replica. Split, the ingress answers 503;
    colocated, the front may go down with its replica first, and Serve's proxy answers
    500 for it."""
    url, pids, engines = _app_processes(server, app_name)

    async def run():
        async with httpx.AsyncClient() as cl:
            return await _signal_under_load(engines, [
                cl.post(url + C, json={"model": MODEL, "prompt": f"saga {i}", "max_tokens": 400,
                                       "ignore_eos": True}, timeout=120) for i in range(4)], signal.SIGSTOP)

    t = time.monotonic()
    held = asyncio.run(run())
    waited = time.monotonic() - t - 1.5
    print(f"engine stopped mid-load: {[r.status_code for r in held]} after {waited:.1f} s")
    errors = (503,) if app_name == "rel" else (503, 500)
    assert all(r.status_code in errors for r in held), [r.text for r in held]
    assert waited < STALL_S + 30, "the stalled requests were held too long"
    for e in engines:
        assert exited(e, 30), f"stalled engine process {e} was left running"
    r = _wait_served(url, app_name, pids)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("app_name", ["rel", "colo"])
def test_replica_failure_recovers(server, app_name):
    """The replica holding the engine killed under load: no client hangs, each gets its
    answer or an error, the engine process goes too, and a new replica serves. Split,
    the ingress answers 503 with Retry-After; colocated, the HTTP front died with the
    replica, and Serve's proxy answers 500 for it."""
    url = server.urls[app_name]
    pids = replica_pids(app_name)
    assert pids, "no LLMServer replica process found"
    engines = [e for p in pids for e in engine_pids(p)]
    assert len(engines) == len(pids), "each replica runs its engine in a process of its own"

    async def client(cl, i):
        t = time.monotonic()
        try:
            r = await cl.post(url + C, json={"model": MODEL, "prompt": f"story {i}", "max_tokens": 400,
                                             "ignore_eos": True}, timeout=90)
            return r.status_code, time.monotonic() - t
        except httpx.HTTPError as e:
            return type(e).__name__, time.monotonic() - t

    async def run():
        async with httpx.AsyncClient() as cl:
            return await _signal_under_load(pids, [client(cl, i) for i in range(8)])

    results = asyncio.run(run())
    print(f"replica killed mid-load; in-flight outcomes: {results}")
    assert all(elapsed < 90 for _, elapsed in results), "a client hung"
    errors = (503,) if app_name == "rel" else (500,)
    assert all(code in (200, *errors) for code, _ in results), results   # an error, or the answer
    for e in engines:     # a killed replica's engine process exits too: no model left in memory
        assert exited(e, 30), f"engine process {e} outlived its replica"
    r = _wait_served(url, app_name, pids)
    assert r.status_code == 200, r.text
    assert replica_pids(app_name) and not set(replica_pids(app_name)) & set(pids)


def test_a_lost_response_store_is_replaced_empty(server):
    """The store's replica killed: Serve replaces it, the requests meanwhile wait for it
    (none fails), and the new store starts empty, so a chain from before is a 400 that
    says its response is gone."""
    c = openai.OpenAI(base_url=server.urls["rel"] + "/v1", api_key="unused", max_retries=0, timeout=90)
    before = c.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    [pid] = live_pids("-f", "ServeReplica:rel:ResponseStore")
    os.kill(pid, signal.SIGKILL)
    assert exited(pid, 30)
    t = time.monotonic()
    after = c.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert time.monotonic() - t < 60 and c.responses.retrieve(after.id).id == after.id
    assert live_pids("-f", "ServeReplica:rel:ResponseStore") != [pid]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(before.id)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="hi", max_output_tokens=2, previous_response_id=before.id)
    assert e.value.body["code"] == "previous_response_not_found"


def test_a_background_response_whose_replica_died_reads_failed(server):
    """The ingress replica running a background response killed: Serve replaces it, and
    once the response's lease lapses (`LEASE_S` in this app) polling it reads failed,
    with a server error, rather than `in_progress` for ever."""
    c = openai.OpenAI(base_url=server.urls["rel"] + "/v1", api_key="unused", max_retries=0, timeout=30)
    r = c.responses.create(model=MODEL, input="Tell me a long story", temperature=0, max_output_tokens=1500,
                           background=True)
    ingress = live_pids("-f", "ServeReplica:rel:OpenAIIngress")
    assert r.status == "in_progress" and ingress
    for pid in ingress:
        os.kill(pid, signal.SIGKILL)
    t, polled = time.monotonic(), []
    while time.monotonic() - t < 60:
        try:
            got = c.responses.retrieve(r.id)
        except openai.APIError:        # no ingress replica yet
            time.sleep(0.5)
            continue
        polled.append(got.status)
        if got.status != "in_progress":
            break
        time.sleep(0.5)
    print(f"after the kill: {len(polled)} polls answered, last {polled[-1:]}, {time.monotonic() - t:.1f} s")
    assert polled and polled[-1] == "failed", polled
    assert got.error.code == "server_error"
    assert [p for p in live_pids("-f", "ServeReplica:rel:OpenAIIngress") if p in ingress] == []
