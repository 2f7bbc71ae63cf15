"""The Responses API's translation (deployments/responses.py): items to chat messages,
and a choice's text to output items, where the stream of events and the whole response
must agree however the text is cut into chunks. Over HTTP it is tested in test_http."""

import json
import random

import pytest
from pydantic import ValidationError

from deployments.chat_output import ChoiceParser
from deployments.harmony import HarmonyParser
from deployments.reasoning import ReasoningSplit
from deployments.responses import (ResponseBody, ResponseEvents, ResponsesRequest, TextLogprobs, reasoning_tokens,
                                  whole_response)
from deployments.tools import ToolOutput

TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _request(**kw) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **kw})


def test_items_become_the_chat_conversation():
    """Instructions lead as the system message; a call joins the assistant turn before
    it, its output is a tool message, and reasoning goes with the assistant turn after."""
    r = _request(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "now?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
        {"role": "developer", "content": "Answer in French."},
    ])
    call = {"type": "function", "function": {"name": "get_weather"}}
    assert r.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather now?"},
        {"role": "assistant", "content": "Checking.", "reasoning": "look",
         "tool_calls": [{"id": "call_1", **call, "function": {**call["function"], "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_2", **call, "function": {**call["function"], "arguments": "{}"}}]},
        {"role": "developer", "content": "Answer in French."},
    ]


def test_tools_choice_and_format_become_the_chat_fields():
    body = _request(tools=[{"type": "function", **TOOL}], tool_choice={"type": "function", "name": "get_weather"},
                    text={"format": {"type": "json_schema", "name": "w", "description": "A w.",
                                     "schema": {"type": "object"}, "strict": True}},
                    max_output_tokens=9, parallel_tool_calls=False).chat_body()
    assert body["tools"] == [{"type": "function", "function": TOOL}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "w", "description": "A w.", "schema": {"type": "object"}, "strict": True}}
    assert body["max_completion_tokens"] == 9 and body["parallel_tool_calls"] is False
    assert _request(text={"format": {"type": "json_object"}}).chat_body()["response_format"] == {"type": "json_object"}
    assert "response_format" not in _request(text={"format": {"type": "text"}}).chat_body()


@pytest.mark.parametrize("bad", [
    {"input": []},
    {"truncation": "middle"},
    {"background": True, "store": False},
    {"background": True, "stream": True},
    {"tools": [{"type": "web_search"}]},
    {"text": {"format": {"type": "json_schema", "name": "x"}}},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
    {"include": ["file_search_call.results"]},
    {"temperature": 3},
    {"top_logprobs": 21},
    {"prompt": {"id": "pmpt_1"}},
    {"stream_options": {"include_obfuscation": False}},
    {"max_tool_calls": 0},
])
def test_what_cannot_be_served_is_refused(bad):
    with pytest.raises(ValidationError):
        _request(**bad)


def test_fields_that_change_nothing_here_are_taken():
    """OpenAI's fields that shape nothing this server makes: a cap on built-in tool calls
    (it has none), stream padding, and a null stored prompt."""
    plain = _request(max_output_tokens=4).chat_body()
    assert _request(max_output_tokens=4, max_tool_calls=2, prompt=None).chat_body() == plain
    streamed = _request(max_output_tokens=4, stream=True)
    assert _request(max_output_tokens=4, stream=True, stream_options={"include_obfuscation": True}).chat_body() \
        == streamed.chat_body()


def _parser(mode=None, opened=False):
    if mode in ("harmony", "harmony-calls"):   # gpt-oss's turns, its calls parsed or not
        return HarmonyParser(mode == "harmony-calls")
    tools = ToolOutput(mode, None, [TOOL]) if mode else None
    return ChoiceParser(ReasoningSplit("<think>", "</think>", opened), tools)


def _without_ids(items):
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def _whole(parser, text, finish, logprobs=None) -> list[dict]:
    """The whole response's items: the choice's pieces, all at once."""
    return whole_response(ResponseBody(_request(), "m"), parser.parts(text, finish)[0], finish, {}, logprobs)["output"]


@pytest.mark.parametrize("text, mode, finish", [
    ("<think>plan it</think>Hello there", None, "stop"),
    ("Hello there", None, "length"),
    ("<think>still thinking", None, "length"),
    ("Say<think>plan</think> so", None, "stop"),
    ('<think>pick</think>[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "required", "stop"),
    ('{"city": "Oslo"}', "get_weather", "stop"),
    ('{"city": "Os', "get_weather", "length"),
    ('<think>pick</think>[{"name": "get_weather", "parameters": {"city": "Par', "required", "length"),
    ("<|channel|>analysis<|message|>plan it<|end|><|start|>assistant<|channel|>final<|message|>Hello there",
     "harmony", "stop"),
    ("<|channel|>analysis<|message|>still thinking", "harmony", "length"),
    ("<|channel|>analysis<|message|>pick<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
     '<|constrain|>json<|message|>{"city": "Paris"}', "harmony-calls", "stop"),
    ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather<|channel|>'
     'commentary json<|message|>{"city": "Pa', "harmony-calls", "length"),
])
def test_the_stream_and_the_whole_response_agree(text, mode, finish):
    """However the text is cut, the events add up to the items the whole response has,
    in the order the text wrote them: each item added once and done once under one id,
    its deltas joining to its text, the numbers in sequence, the response last. The
    items hold what the chat message of the same text holds. The item the token limit
    cut, whatever its kind, reads incomplete, as does the empty message after reasoning
    the limit cut; every item before it reads completed."""
    whole = _whole(_parser(mode), text, finish)
    statuses = [i["status"] for i in whole]
    done = len(whole) if finish != "length" else 0 if "still" in text else len(whole) - 1
    assert statuses == ["completed"] * done + ["incomplete"] * (len(whole) - done)
    message, _ = _parser(mode).message(text, finish)
    kinds = {"reasoning": "reasoning_text", "message": "output_text"}
    said = {k: "".join(c["text"] for i in whole if i["type"] == k for c in i["content"] if c["type"] == t)
            for k, t in kinds.items()}
    assert said == {"reasoning": message.get("reasoning") or "", "message": message.get("content") or ""}
    assert [i["arguments"] for i in whole if i["type"] == "function_call"] == \
        [c["function"]["arguments"] for c in message.get("tool_calls") or []]
    for seed in range(5):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        parser, stream = _parser(mode), ResponseEvents(ResponseBody(_request(), "m"))
        events = stream.opening()
        for i, chunk in enumerate(chunks):
            events += stream.feed(parser.parts(chunk, finish if i == len(chunks) - 1 else None)[0])
        events += stream.closing(finish, {})
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = events[-1]
        assert final["type"] == f"response.{'incomplete' if finish == 'length' else 'completed'}"
        assert _without_ids(final["response"]["output"]) == _without_ids(whole)
        added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert added == [d["id"] for d in done] == [item["id"] for item in final["response"]["output"]]
        for item in done:
            pieces = "".join(e["delta"] for e in events if e.get("item_id") == item["id"] and e["type"].endswith(".delta"))
            text_of = item.get("arguments") if item["type"] == "function_call" else item["content"][0]["text"]
            assert pieces == text_of


def test_text_before_the_reasoning_keeps_its_place():
    whole = _whole(_parser(), "Say<think>plan</think> so", "stop")
    assert [(i["type"], i["content"][0]["text"]) for i in whole] == \
        [("message", "Say"), ("reasoning", "plan"), ("message", " so")]


def test_reasoning_tokens_count_up_to_the_end_marker():
    assert reasoning_tokens([5, 6, 99, 7], [99], True) == 3
    assert reasoning_tokens([5, 6, 7], [99], True) == 3
    assert reasoning_tokens([5, 6, 7], [99], False) == 0
    assert reasoning_tokens([5, 98, 6, 98, 99, 7], [98, 99], True) == 5   # an end marker of two tokens
    assert reasoning_tokens([5, 6], None, True) == 2


def test_a_whole_response_repeats_the_request():
    r = _request(tools=[{"type": "function", **TOOL}], metadata={"k": "v"}, max_output_tokens=5)
    body = ResponseBody(r, "m").body("completed", [], None)
    assert body["tools"] == [{"type": "function", **TOOL}] and body["tool_choice"] == "auto"
    assert body["metadata"] == {"k": "v"} and body["store"] is False and body["max_output_tokens"] == 5
    assert body["text"] == {"format": {"type": "text"}} and body["previous_response_id"] is None
    json.dumps(body)
    chained = ResponseBody(_request(previous_response_id="resp_1"), "m", stored=True).body("completed", [], None)
    assert chained["store"] is True and chained["previous_response_id"] == "resp_1"


def test_input_items_get_ids_and_a_continued_request_reads_as_the_whole_conversation():
    """Items a store keeps carry ids (a client's kept, the others made) and content
    parts; a stored conversation put before a request's own input gives the chat
    messages of the whole conversation sent at once."""
    first = _request(input="Weather?")
    [item] = first.input_items()
    assert item["id"].startswith("msg_") and item["status"] == "completed"
    assert item["role"] == "user" and item["content"] == [{"type": "input_text", "text": "Weather?"}]
    assert first.input_items()[0]["id"] != item["id"]     # fresh each time; stored once
    output = [{"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
               "arguments": "{}", "status": "completed"}]
    follow = _request(instructions="Be brief.", tools=[{"type": "function", **TOOL}],
                      input=[{"type": "function_call_output", "call_id": "call_1", "output": "cold"},
                             {"role": "assistant", "content": "Noted.", "id": "msg_mine"}])
    own = follow.input_items()
    assert own[0]["id"].startswith("fco_") and own[1]["id"] == "msg_mine"
    assert own[1]["content"] == [{"type": "output_text", "text": "Noted."}]
    continued = follow.with_input([item, *output, *own])
    whole = _request(instructions="Be brief.", tools=[{"type": "function", **TOOL}],
                     input=[{"role": "user", "content": "Weather?"}, *output,
                            {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
                            {"role": "assistant", "content": "Noted."}])
    assert continued.chat_body() == whole.chat_body()
    assert continued.input_items() == [item, *output, *own]   # ids kept


def test_turns_start_at_user_messages():
    """`truncation: "auto"` cuts only where a turn begins, never between a call and its
    output or reasoning and its answer."""
    r = _request(input=[
        {"role": "system", "content": "s"}, {"role": "user", "content": "a"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "o"},
        {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
    assert r.turn_starts() == [1, 6]
    assert _request(input="hi").turn_starts() == [0]
    assert ResponseBody(_request(truncation="auto"), "m").body("completed", [], None)["truncation"] == "auto"


def _stored(rid: str, text: str = "x") -> dict:
    return {"id": rid, "object": "response", "status": "completed",
            "output": [{"type": "message", "id": f"msg_{rid}", "text": text}]}


def test_the_store_keeps_the_newest_within_its_bounds_and_each_owners_own():
    import asyncio

    from deployments.response_store import ResponseStore, StoreClient

    async def run():
        store = StoreClient(ResponseStore(max_responses=3, max_bytes=2000))
        for i in range(4):
            assert await store.put("a", _stored(f"r{i}"), [{"id": f"in{i}"}])
        assert await store.get("a", "r0") is None                       # fourth put evicts the oldest
        await store.get("a", "r1")                                      # read: now the newest
        assert await store.put("a", _stored("r4"), [])
        assert await store.get("a", "r2") is None and await store.get("a", "r1") is not None
        rec = await store.get("a", "r3")
        assert rec.conversation == [{"id": "in3"}, *_stored("r3")["output"]]
        assert await store.get("b", "r3") is None and not await store.delete("b", "r3")   # another key's
        assert await store.delete("a", "r3") and await store.get("a", "r3") is None
        assert not await store.put("a", _stored("big", "y" * 3000), [])                 # alone over the bound
        assert await store.put("a", _stored("r5", "y" * 1850), [])                      # pushes out the rest
        assert (await store._store.stats())["responses"] == 1 and await store.get("a", "r5") is not None
        size = (await store._store.stats())["bytes"]
        assert await store.put("a", _stored("r5", "z"), []) and (await store._store.stats())["bytes"] < size
        running = {**_stored("bg"), "status": "in_progress"}
        assert await store.put("a", running, []) and await store.cancel("b", "bg") is None
        assert await store.cancel("a", "bg") == (True, {**running, "status": "cancelled"})
        assert await store.put("a", {**running, "status": "completed"}, [])      # too late: stays cancelled
        assert (await store.get("a", "bg")).response["status"] == "cancelled"
        assert await store.cancel("a", "bg") == (False, {**running, "status": "cancelled"})
        assert (await store.cancel("a", "r5"))[0] is False                        # finished, not background

    asyncio.run(run())


def test_a_turn_the_conversation_store_refuses_is_logged(caplog):
    """A response's turn that its conversation cannot take (gone, or too large) costs
    the caller nothing, but is logged; one it takes is not."""
    import asyncio
    import logging

    from deployments.conversation_store import ConversationStore
    from deployments.ingress import _appended, _quietly

    store = ConversationStore(max_conversations=2, max_bytes=400)
    conv = store.create("a", [], {})
    item = {"id": "m1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}

    async def turn(owner, items):
        return store.append(owner, conv["id"], items)

    serve_log = logging.getLogger("ray.serve")   # the replicas' logger, which Ray keeps to itself
    serve_log.addHandler(caplog.handler)
    try:
        for owner, items, refused in (("a", [item], False), ("b", [item], True), ("a", [item] * 9, True)):
            caplog.clear()
            asyncio.run(_quietly(_appended(turn(owner, items)), "the turn"))
            assert ("the turn not stored: refused" in caplog.text) is refused, (owner, len(items))
    finally:
        serve_log.removeHandler(caplog.handler)


def test_the_conversation_store_keeps_each_owners_own_within_its_bounds():
    from deployments.conversation_store import ConversationStore

    import json

    msg = [{"id": "m1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 100}]}]
    size = len(json.dumps(msg[0]))
    store = ConversationStore(max_conversations=2, max_bytes=3 * size)
    a = store.create("a", msg, {"k": "v"})
    assert a["object"] == "conversation" and store.get("a", a["id"]) == a and store.get("b", a["id"]) is None
    assert store.items("a", a["id"]) == msg and store.items("b", a["id"]) is None
    assert store.append("b", a["id"], msg) == (False, None) and store.update("b", a["id"], {}) is None
    assert store.append("a", a["id"], [{**msg[0], "id": "m2"}]) == (True, [{**msg[0], "id": "m2"}])
    assert store.stats() == {"conversations": 1, "conversation_bytes": 2 * size}
    assert store.append("a", a["id"], [{**msg[0], "id": "m3"}, {**msg[0], "id": "m4"}]) == (True, None)   # over
    assert store.delete_item("a", a["id"], "nope") == (store.get("a", a["id"]), False)
    assert store.delete_item("a", a["id"], "m1")[1] and [i["id"] for i in store.items("a", a["id"])] == ["m2"]
    assert store.stats()["conversation_bytes"] == size
    b = store.create("a", msg, {})
    store.get("a", a["id"])                                   # read: a is now the newest
    c = store.create("a", [], {})                             # a third: the least recently used goes
    assert store.get("a", b["id"]) is None and store.get("a", a["id"]) and store.get("a", c["id"])
    assert store.append("a", c["id"], msg + [{**msg[0], "id": "m5"}, {**msg[0], "id": "m6"}])[1]   # a goes, by bytes
    assert store.get("a", a["id"]) is None and store.stats() == {"conversations": 1, "conversation_bytes": 3 * size}
    assert store.create("a", msg * 4, {}) is None             # alone over the bound
    assert not store.delete("b", c["id"]) and store.delete("a", c["id"]) and store.stats()["conversation_bytes"] == 0
    assert store.update("a", c["id"], {"x": "y"}) is None and store.delete_item("a", c["id"], "m1") == (None, False)


def test_the_chat_store_lists_each_owners_own_oldest_first_within_its_bounds():
    from deployments.chat_store import ChatCompletionStore

    def made(cid, model="m", **metadata):
        return {"id": cid, "object": "chat.completion", "model": model, "choices": [], "metadata": metadata}

    store = ChatCompletionStore(max_completions=3, max_bytes=10_000)
    assert store.put("a", made("c1", run="x"), [{"role": "user", "content": "hi"}])
    assert store.put("a", made("c2", "n", run="x"), []) and store.put("b", made("c3", run="x"), [])
    assert [c["id"] for c in store.listed("a", None, {"run": "x"})] == ["c1", "c2"]
    assert [c["id"] for c in store.listed("a", "n", {})] == ["c2"] and store.listed("a", None, {"run": "y"}) == []
    assert store.messages("a", "c1") == [{"role": "user", "content": "hi", "id": "c1-0"}]
    assert store.get("b", "c1") is None and store.update("b", "c1", {}) is None and not store.delete("b", "c1")
    assert store.update("a", "c1", {"run": "y"})["metadata"] == {"run": "y"}
    assert [c["id"] for c in store.listed("a", None, {"run": "y"})] == ["c1"]
    assert store.put("a", made("c4"), [])                      # a fourth: the oldest goes
    assert store.get("a", "c1") is None and store.stats()["chat_completions"] == 3
    assert not store.put("a", made("big", note="x" * 512 * 20), [{"content": "y" * 10_000}])   # alone over
    assert store.delete("a", "c2") and store.messages("a", "c2") is None
    assert store.stats()["chat_completion_bytes"] == sum(k.size for k in store.records.values())


def test_a_background_response_whose_lease_lapses_reads_failed(monkeypatch):
    """A background response reads `in_progress` while its replica renews its lease;
    once the lease lapses (the replica went away) it reads failed, for good, and a later
    put from a replica that was only slow does not change that."""
    import asyncio

    import deployments.response_store as store_module
    from deployments.response_store import ORPHANED, ResponseStore, StoreClient

    now = [100.0]
    monkeypatch.setattr(store_module, "monotonic", lambda: now[0])

    async def run():
        store = StoreClient(ResponseStore(background_lease_s=30))
        running = {**_stored("bg"), "status": "in_progress"}
        assert await store.put("a", running, [])
        now[0] += 29
        assert (await store.get("a", "bg")).response["status"] == "in_progress"
        assert (await store.renew("a", "bg")).response["status"] == "in_progress"
        now[0] += 29                                             # 58 s on, renewed 29 s ago
        assert (await store.get("a", "bg")).response["status"] == "in_progress"
        assert await store.renew("b", "bg") is None              # another key's: not renewed
        now[0] += 2
        got = (await store.get("a", "bg")).response
        assert got == {**running, "status": "failed", "error": ORPHANED}
        assert await store.put("a", {**running, "status": "completed"}, [])
        assert (await store.renew("a", "bg")).response["status"] == "failed"
        assert (await store.cancel("a", "bg"))[0] is False
        assert await store.put("a", _stored("done"), [])        # finished responses have no lease
        now[0] += 1000
        assert (await store.get("a", "done")).response["status"] == "completed"

    asyncio.run(run())


def test_a_background_response_stops_when_its_stored_copy_is_cancelled(monkeypatch):
    """A cancel that reached another ingress replica only marks the stored response; the
    replica running it sees the mark and stops it, as it does when it is deleted, and
    when its lease lapsed (the store reads it failed: a replica stalled that long)."""
    import asyncio

    import deployments.ingress as ingress_module
    from deployments.ingress import OpenAIIngress
    from deployments.response_store import ResponseStore, StoreClient

    monkeypatch.setattr(ingress_module, "BACKGROUND_POLL_S", 0.01)
    ingress = OpenAIIngress.__new__(OpenAIIngress)   # only its store is used
    ingress.store = StoreClient(ResponseStore())

    async def run():
        outcome = []
        for stop in ("cancel", "delete", "lapse"):
            await ingress.store.put(None, {**_stored(stop), "status": "in_progress"}, [])
            running = asyncio.create_task(asyncio.sleep(60))
            watcher = asyncio.create_task(ingress._watch_cancel(None, stop, running))
            await asyncio.sleep(0.05)
            assert not running.done()
            if stop == "lapse":
                ingress.store._store._records.peek(stop).renewed -= 3600
            else:
                await getattr(ingress.store, stop)(None, stop)
            await asyncio.wait_for(watcher, 2)
            await asyncio.sleep(0)
            outcome.append(running.cancelled())
        return outcome

    assert asyncio.run(run()) == [True, True, True]


def test_input_items_pages_as_openais_list():
    from deployments.http_error import HTTPError, items_page as input_items_page

    items = [{"id": f"i{n}"} for n in range(5)]
    page = input_items_page(items, {})
    assert [i["id"] for i in page["data"]] == ["i4", "i3", "i2", "i1", "i0"] and not page["has_more"]
    page = input_items_page(items, {"order": "asc", "limit": "2"})
    assert [i["id"] for i in page["data"]] == ["i0", "i1"] and page["has_more"] and page["last_id"] == "i1"
    page = input_items_page(items, {"order": "asc", "limit": "2", "after": "i3"})
    assert [i["id"] for i in page["data"]] == ["i4"] and not page["has_more"] and page["first_id"] == "i4"
    assert input_items_page(items, {"after": "i0"}) == {"object": "list", "data": [], "first_id": None,
                                                        "last_id": None, "has_more": False}
    for bad in ({"order": "up"}, {"limit": "0"}, {"limit": "101"}, {"limit": "x"}, {"after": "nope"}):
        with pytest.raises(HTTPError) as e:
            input_items_page(items, bad)
        assert e.value.status == 400 and e.value.param == next(iter(bad))


def test_auto_calls_in_the_models_own_format_stream_as_whole_items(format_model):
    """"auto": calls the model writes between its markers (mlx-lm's parser) come out as
    function_call items after the text, in the stream as whole."""
    from mlx_lm.utils import load_tokenizer
    from pathlib import Path

    tok = load_tokenizer(Path(format_model))
    text = ('<think>check</think>Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>')

    def parser():
        return ChoiceParser(ReasoningSplit(tok.think_start, tok.think_end, False), ToolOutput("auto", tok, [TOOL]))

    whole = _whole(parser(), text, "stop")
    assert [i["type"] for i in whole] == ["reasoning", "message", "function_call"]
    assert json.loads(whole[2]["arguments"]) == {"city": "Paris"} and whole[1]["content"][0]["text"] == "Checking."
    for cut in range(1, len(text), 7):
        p, stream = parser(), ResponseEvents(ResponseBody(_request(), "m"))
        events = stream.opening()
        for chunk, finish in ((text[:cut], None), (text[cut:], "stop")):
            events += stream.feed(p.parts(chunk, finish)[0])
        events += stream.closing("stop", {})
        assert _without_ids(events[-1]["response"]["output"]) == _without_ids(whole)


THINK, UNTHINK, EOS = 1, 2, 3


def _tokens(pieces: list[str]) -> list[tuple[int, str, dict]]:
    """Tokens of these texts, the think markers and an end token by their own ids, each
    with an entry naming its position; the engine's text leaves the end token out."""
    ids = {"<think>": THINK, "</think>": UNTHINK, "<eos>": EOS}
    return [(ids.get(p, 10 + i), p.encode(), {"token": p, "at": i}) for i, p in enumerate(pieces)]


def _text_of(tokens) -> str:
    return b"".join(p for t, p, _ in tokens if t != EOS).decode()


def _stream_with_logprobs(parser, tokens, state, cuts, finish):
    """A response streamed in chunks of tokens cut at `cuts`, with output_text logprobs."""
    lps = TextLogprobs((THINK, UNTHINK), state)
    stream = ResponseEvents(ResponseBody(_request(), "m"), lps)
    events = stream.opening()
    bounds = [0, *cuts, len(tokens)]
    for a, b in zip(bounds, bounds[1:]):
        lps.add(tokens[a:b])
        events += stream.feed(parser.parts(_text_of(tokens[a:b]), finish if b == len(tokens) else None)[0])
    return events + stream.closing(finish, {})


@pytest.mark.parametrize("pieces, opened, want", [
    (["Hel", "lo", " there", "<eos>"], False, ["Hel", "lo", " there", "<eos>"]),
    (["<think>", "plan", " it", "</think>", "Hel", "lo"], False, ["Hel", "lo"]),
    (["<think>", "a", "</think>", "Hi", "<eos>"], False, ["Hi", "<eos>"]),
    (["Say", "<think>", "plan", "</think>", " so", "<eos>"], False, ["Say", " so", "<eos>"]),
    (["plan", "</think>", "Hi", "<think>", "!"], True, ["Hi", "<think>", "!"]),
    (["still", " thinking", "<eos>"], True, []),
])
def test_output_text_logprobs_are_the_texts_own_tokens(pieces, opened, want):
    """output_text's logprobs are the answer's tokens, whole and however the stream is
    cut: never the reasoning or its markers (a start marker after the reasoning is
    text, as the split reads it), and the deltas' entries add up to the item's."""
    tokens = _tokens(pieces)
    lps = TextLogprobs((THINK, UNTHINK), "thinking" if opened else "may_think")
    lps.add(tokens)
    whole = _text_logprobs(_whole(_parser(opened=opened), _text_of(tokens), "stop", lps))
    assert [e["token"] for e in whole] == want
    for seed in range(6):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(tokens)), rng.randint(0, len(tokens) - 1)))
        events = _stream_with_logprobs(_parser(opened=opened), tokens, "thinking" if opened else "may_think",
                                       cuts, "stop")
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert _text_logprobs(done) == whole
        deltas = [x for e in events if e["type"] == "response.output_text.delta" for x in e["logprobs"]]
        assert deltas == whole
        assert _text_logprobs(events[-1]["response"]["output"]) == whole


def _text_logprobs(items: list[dict]) -> list[dict]:
    """The logprobs of every message item's text, in order."""
    return [x for i in items if i["type"] == "message" for x in i["content"][0]["logprobs"]]


def test_output_text_logprobs_leave_out_a_calls_markup(format_model):
    """"auto": the tokens of a call the model writes in its own format, after its text,
    are not the text's: its logprobs stop where the content does."""
    from mlx_lm.utils import load_tokenizer
    from pathlib import Path

    tok = load_tokenizer(Path(format_model))
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = ["Check", "ing", "."] + [text[i:i + 3] for i in range(len("Checking."), len(text), 3)]
    tokens = _tokens(pieces)

    def parser():
        return ChoiceParser(ReasoningSplit(tok.think_start, tok.think_end, False), ToolOutput("auto", tok, [TOOL]))

    lps = TextLogprobs((THINK, UNTHINK), "may_think")
    lps.add(tokens)
    items = _whole(parser(), _text_of(tokens), "stop", lps)
    assert [i["type"] for i in items] == ["message", "function_call"]
    whole = items[0]["content"][0]["logprobs"]
    assert [e["token"] for e in whole] == ["Check", "ing", "."] and items[0]["content"][0]["text"] == "Checking."
    for cut in range(1, len(tokens)):
        events = _stream_with_logprobs(parser(), tokens, "may_think", [cut], "stop")
        [done] = [e["item"] for e in events if e["type"] == "response.output_item.done"
                  and e["item"]["type"] == "message"]
        assert done["content"][0]["logprobs"] == whole, cut


def test_logprobs_of_a_model_with_multi_token_think_markers_are_refused(tmp_path):
    """A thinking model whose markers are several tokens (mlx-lm reads "<|channel>thought"
    and "<channel|>" so): its answer's tokens cannot be told from its reasoning's, so
    output_text logprobs are a 400 that says so; without them the request goes on."""
    from deployments.ingress import HTTPError, OpenAIIngress
    from runtime.models.loader import load_tokenizer
    from runtime.models.tiny import make_model

    model = make_model(tmp_path / "m", hidden=32, layers=1, heads=2, kv_heads=1, vocab_size=320,
                       added_tokens=("<|channel>", "<channel|>"))
    ingress = OpenAIIngress.__new__(OpenAIIngress)   # only its tokenizer is read
    ingress.tokenizer, ingress.harmony = load_tokenizer(str(model)), None
    assert ingress.tokenizer.has_thinking and len(ingress.tokenizer.think_start_tokens) > 1
    with pytest.raises(HTTPError) as e:
        ingress._text_logprobs_markers(_request(include=["message.output_text.logprobs"]))
    assert e.value.status == 400 and e.value.param == "include" and "single tokens" in str(e.value)
    assert ingress._text_logprobs_markers(_request()) is None
