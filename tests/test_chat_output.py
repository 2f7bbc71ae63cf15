"""A chat choice's text, without HTTP: tool calls (the constraint a forced choice puts
on the output; the text turned into `content` and `tool_calls` with mlx-lm's own parser
for the model's format) and reasoning (what a thinking model writes between its think
markers), whole and streamed in any pieces."""

import json
import random
from functools import partial
from typing import Literal

import openai
import pydantic
import pytest

from deployments.protocol import ChatCompletionRequest, ResponseFormat, chat_prompt_ids
from deployments.reasoning import ReasoningSplit
from deployments.chat_output import ChoiceParser, joined_pieces
from deployments.logprobs import TokenText
from deployments.tools import ToolOutput, auto_constraint, constraint
from runtime import EngineConfig, LLMEngine, SamplingParams
from runtime.models.loader import load_tokenizer
from runtime.structured_output import GrammarCompiler, reasoning_state

from .conftest import MISTRAL_LIST_TEMPLATE, MISTRAL_TEMPLATE, make_format_model

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                            "required": ["zone"], "additionalProperties": False}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine(default_model):
    return LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=128))


@pytest.fixture(scope="module")
def tokenizer(format_model):
    tok = load_tokenizer(format_model)
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>" and tok.think_start == "<think>"
    return tok


@pytest.fixture(scope="module")
def marker_token_tokenizer(tmp_path_factory):
    """The format model's tokenizer, but with "<tool_call>" and "</tool_call>" as tokens
    it adds whole, as Qwen's tokenizers have them (not flagged special there; llguidance
    treats them as special all the same)."""
    tok = load_tokenizer(make_format_model(tmp_path_factory.mktemp("marker-tokens") / "model",
                                           ("<think>", "</think>", "<tool_call>", "</tool_call>")))
    assert len(tok.encode("<tool_call>", add_special_tokens=False)) == 1 and tok.tool_call_start == "<tool_call>"
    return tok


@pytest.fixture(scope="module")
def unthinking_tokenizer(tmp_path_factory):
    """The format model's template and call markers (added tokens, as Qwen2.5's), but no
    think markers in the vocabulary: a model of the call format that does not think."""
    tok = load_tokenizer(make_format_model(tmp_path_factory.mktemp("unthinking") / "model",
                                           ("<tool_call>", "</tool_call>")))
    assert tok.has_tool_calling and not tok.has_thinking
    return tok


def _streamed(out: ToolOutput, text: str, rng: random.Random):
    """Feed `text` in random pieces, then close: all content and calls."""
    content, calls, i = "", [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        c, k = out.feed(text[i:i + n])
        content, calls, i = content + c, calls + k, i + n
    c, k = out.close()
    return content + c, calls + k


def _plain(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text, content, cities", [
    ("Let me look." + CALL % "Paris", "Let me look.", ["Paris"]),
    (CALL % "Oslo" + " and " + CALL % "Paris" + " done", " and  done", ["Oslo", "Paris"]),
    ("No call here, only < and <tool text.", "No call here, only < and <tool text.", []),
    ("Cut short: " + (CALL % "Oslo")[:30], "Cut short: ", []),
])
def test_auto_splits_content_from_calls_whole_and_in_any_pieces(tokenizer, text, content, cities):
    whole, reason = ToolOutput("auto", tokenizer, [WEATHER]).message(text, "stop")
    assert (whole["content"] or "") == content
    assert _plain(whole.get("tool_calls", [])) == [("get_weather", {"city": c}) for c in cities]
    assert reason == ("tool_calls" if cities else "stop")
    for seed in range(20):
        got, calls = _streamed(ToolOutput("auto", tokenizer, [WEATHER]), text, random.Random(seed))
        assert got == content and _plain(calls) == _plain(whole.get("tool_calls", []))
        assert [c["index"] for c in calls] == list(range(len(calls)))


def test_named_streams_arguments_and_required_parses_the_list(tokenizer):
    args = '{"city": "Oslo"}'
    content, calls = _streamed(ToolOutput("get_weather"), args, random.Random(0))
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(c["function"]["arguments"] for c in calls) == args
    whole, reason = ToolOutput("get_weather").message(args, "stop")
    assert whole["content"] is None and _plain(whole["tool_calls"]) == [("get_weather", {"city": "Oslo"})]
    assert reason == "stop"   # OpenAI's for a function it was made to call
    listed = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "Paris"}}]'
    whole, reason = ToolOutput("required").message(listed, "stop")
    assert _plain(whole["tool_calls"]) == [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Paris"})]
    assert reason == "tool_calls"
    cut, reason = ToolOutput("required").message(listed[:40], "length")
    head = '[{"name": "get_time", "parameters": '
    assert [c["function"] for c in cut["tool_calls"]] == [{"name": "get_time", "arguments": listed[len(head):40]}]
    assert reason == "length"   # as streamed: the call, its arguments cut short
    for seed in range(20):   # streamed in any pieces: headers, then argument pieces
        content, pieces = _streamed(ToolOutput("required"), listed, random.Random(seed))
        calls = {}
        for p in pieces:
            calls.setdefault(p["index"], {"name": p["function"].get("name"), "arguments": ""})
            calls[p["index"]]["arguments"] += p["function"]["arguments"]
        assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
            [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Paris"})]
    tricky = '[{"name": "get_time", "parameters": {"zone": "a}\\"]{"}}]'
    (call,), _ = ToolOutput("required").message(tricky, "stop")[0]["tool_calls"], None
    assert json.loads(call["function"]["arguments"]) == {"zone": 'a}"]{'}


def test_a_chunk_carries_one_entry_a_call():
    """However much text a chunk holds (a paced stream sends several steps' tokens at
    once), its `tool_calls` has one entry a call, as OpenAI's chunks do: clients that
    merge chunks by `index` (LangChain's) do not merge entries within one chunk."""
    listed = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "Paris"}}]'
    for size in (5, 40, 60, len(listed)):
        parser, merged = ChoiceParser(None, ToolOutput("required")), []
        for i in range(0, len(listed), size):
            delta, _ = parser.feed(listed[i:i + size], "stop" if i + size >= len(listed) else None)
            indices = [c["index"] for c in delta.get("tool_calls", [])]
            assert indices == sorted(set(indices)), (size, delta)
            for c in delta.get("tool_calls", []):   # across chunks, merged by index
                if c["index"] < len(merged):
                    merged[c["index"]]["arguments"] += c["function"]["arguments"]
                else:
                    merged.append({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        assert [(c["name"], json.loads(c["arguments"])) for c in merged] == \
            [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False), ("named", True)])
def test_forced_choices_make_calls_the_engine_can_only_write_validly(engine, choice, parallel):
    """Sampled at temperature 1 on the embedded model, the constrained output always
    parses into calls of the tools with arguments of their schemas; one call at most
    without parallel_tool_calls."""
    tool_choice = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else choice
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "tools": [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}]})
    params = body.sampling_params(400, None)
    params.n, params.seed = 6, 7
    outs = engine.generate("Call a tool:", params)[0].outputs
    for o in outs:
        text = o.text
        if o.finish_reason == "length":
            # Only an open list of calls can run out (this small model repeats itself):
            # every item it closed is a call.
            assert choice == "required" and parallel, text
            text = text[:text.rindex("}}") + 2] + "]"
        message, _ = ToolOutput(body.tool_mode()).message(text, "stop")
        calls = _plain(message["tool_calls"])
        assert calls and (parallel or len(calls) == 1)
        for name, args in calls:
            assert (name, args) in [("get_weather", {"city": c}) for c in ("Paris", "Oslo")] + \
                [("get_time", {"zone": z}) for z in ("UTC", "CET")]
            assert choice != "named" or name == "get_time"


def test_sampling_params_unchanged_without_tools():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": [{"type": "function", "function": WEATHER}],
                                                 "tool_choice": "none"})
    assert body.tool_mode() is None and body.sampling_params(5, None).structured_outputs is None
    assert SamplingParams().skip_special_tokens


@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>Hmm, let me see.</think>\n\nYes.", False, "Hmm, let me see.", "\n\nYes."),
    ("I think so.</think>The answer.", True, "I think so.", "The answer."),
    ("A plain answer, <thin but no marker.", False, "", "A plain answer, <thin but no marker."),
    ("<think>cut short by max_tok", False, "cut short by max_tok", ""),
])
def test_reasoning_splits_whole_and_in_any_pieces(text, opened, reasoning, content):
    assert ReasoningSplit("<think>", "</think>", opened).split(text) == (reasoning, content)
    for seed in range(20):
        rng, split, got = random.Random(seed), ReasoningSplit("<think>", "</think>", opened), ["", ""]
        i = 0
        while i < len(text):
            n = rng.randint(1, 6)
            r, c = split.feed(text[i:i + n])
            got, i = [got[0] + r, got[1] + c], i + n
        r, c = split.close()
        assert (got[0] + r, got[1] + c) == (reasoning, content)


def test_the_prompt_decides_where_the_split_starts(tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    for kwargs, inside in (({}, False), ({"think_open": True}, True), ({"enable_thinking": False}, False)):
        ids = chat_prompt_ids(tokenizer, msgs, True, None, kwargs)
        assert (reasoning_state(tokenizer, ids) == "thinking") is inside, kwargs
    assert "<think>\n\n</think>" in tokenizer.decode(chat_prompt_ids(tokenizer, msgs, True, None,
                                                                      {"enable_thinking": False}))


def test_reasoning_then_a_tool_call(tokenizer):
    """Reasoning first, then calls parsed out of what is content, as one streams."""
    text = "<think>They want weather.</think>Sure." + CALL % "Oslo"
    for seed in range(10):
        parser = ChoiceParser(ReasoningSplit("<think>", "</think>", False), ToolOutput("auto", tokenizer, [WEATHER]))
        rng, got, i = random.Random(seed), {"reasoning": "", "content": "", "tool_calls": []}, 0
        while i < len(text):
            n = rng.randint(1, 9)
            delta, reason = parser.feed(text[i:i + n], "stop" if i + n >= len(text) else None)
            for key, v in delta.items():
                got[key] += v
            i += n
        assert reason == "tool_calls" and got["reasoning"] == "They want weather." and got["content"] == "Sure."
        assert _plain(got["tool_calls"]) == [("get_weather", {"city": "Oslo"})]


def test_reasoning_effort_reaches_the_template(default_model):
    """OpenAI's `reasoning_effort` (chat) and `reasoning.effort` (Responses) are the
    template's `reasoning_effort` variable; `chat_template_kwargs` set it first."""
    from deployments.responses import ResponsesRequest

    tok = load_tokenizer(default_model)
    tok._tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                                    "|effort={{ reasoning_effort | default('unset') }}")
    hi = [{"role": "user", "content": "hi"}]

    def prompt(extra):
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": hi, **extra})
        return tok.decode(chat_prompt_ids(tok, [m.for_template() for m in body.messages], True, None,
                                          body.template_kwargs()))

    assert prompt({}).endswith("|effort=unset")
    assert prompt({"reasoning_effort": "low"}).endswith("|effort=low")
    assert prompt({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}).endswith(
        "|effort=high")
    chat = ResponsesRequest.model_validate({"model": "m", "input": "hi", "reasoning": {"effort": "minimal"}})
    assert prompt({"reasoning_effort": chat.chat_body()["reasoning_effort"]}).endswith("|effort=minimal")
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": hi, "reasoning_effort": "extreme"})


@pytest.mark.parametrize("marker_tokens", [False, True], ids=["text-markers", "marker-tokens"])
def test_strict_auto_tools_leave_text_free_and_hold_each_call(tokenizer, marker_token_tokenizer, marker_tokens):
    """tool_choice "auto" with a strict function (`auto_constraint`), checked token by
    token by llguidance over the model's own vocabulary: text is free, and a call
    between the markers must name a tool, with a strict tool's arguments in its schema
    and another's any object; one call at most without parallel calls; nothing is
    held when no function is strict."""
    tok = marker_token_tokenizer if marker_tokens else tokenizer
    strict = {**WEATHER, "strict": True}
    constraint = auto_constraint([strict, CLOCK], True, tok)
    assert ("<[" in constraint.grammar) == marker_tokens   # a marker token is matched as that token
    held = partial(_held_by(tok), constraint)

    clock = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 5}}\n</tool_call>'
    assert held("No call here, only < and <tool text.") and held("Let me look." + CALL % "Paris" + " Done.")
    assert not held(CALL % "Rome")                  # outside the strict tool's enum
    assert held(clock)                              # not strict: any object
    assert not held("<tool_call>\nnot json") and not held(CALL.replace("get_weather", "get_news") % "Oslo")
    assert not held(CALL % "Oslo" + " and then <tool_call> as text")
    two = CALL % "Oslo" + "\n" + CALL % "Paris"
    assert held(two) and not _held_by(tok)(auto_constraint([strict, CLOCK], False, tok), two)
    assert auto_constraint([WEATHER, CLOCK], True, tok) is None


def _held_by(tok):
    compiler = GrammarCompiler(tok._tokenizer, 0, [tok.eos_token_id])

    def held(constraint, text):
        matcher = compiler.compile(constraint).matcher
        ids = tok.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    return held


@pytest.mark.parametrize("marker_tokens", [False, True], ids=["text-markers", "marker-tokens"])
def test_strict_auto_tools_let_a_thinking_model_reason_first(tokenizer, marker_token_tokenizer, marker_tokens):
    """The call grammar holds the whole text, so it opens with the reasoning where the
    prompt leaves it to come (`reasoning_state`): may open it ("<think>" is an added
    token, which free text cannot write), is inside it, or has closed it."""
    tok = marker_token_tokenizer if marker_tokens else tokenizer
    held = _held_by(tok)
    strict = {**WEATHER, "strict": True}
    may, inside, closed = (auto_constraint([strict], True, tok, None, s) for s in ("may_think", "thinking", "answer"))
    thought = "<think>Which city?</think>\n\n"
    assert held(may, thought + "Let me look." + CALL % "Paris") and held(may, "Right away." + CALL % "Oslo")
    assert not held(may, thought + CALL % "Rome") and not held(may, thought + "More." + thought)
    assert held(inside, "Which city?</think>" + CALL % "Oslo") and not held(inside, thought + "Hi.")
    assert held(closed, "Hi." + CALL % "Oslo") and not held(closed, thought + "Hi.")


@pytest.mark.parametrize("marker_tokens", [False, True], ids=["text-markers", "marker-tokens"])
def test_auto_tools_with_a_response_format_give_calls_or_the_answer(tokenizer, marker_token_tokenizer, marker_tokens):
    """tools under "auto" beside a `response_format` (OpenAI's Agents SDK sends its
    output type so on every turn): one call at least, or the answer alone in the
    format, never free text alone; with any strict function or none."""
    tok = marker_token_tokenizer if marker_tokens else tokenizer
    held = _held_by(tok)
    answer = {"type": "object", "properties": {"temp": {"type": "integer"}}, "required": ["temp"],
              "additionalProperties": False}
    for tools in ([WEATHER, CLOCK], [{**WEATHER, "strict": True}, CLOCK]):
        c = auto_constraint(tools, True, tok, answer)
        assert held(c, '{"temp": 21}') and held(c, '\n\n{"temp": 21}')
        assert not held(c, '{"temp": "warm"}') and not held(c, "It is warm.") and not held(c, '{"temp": 21} and more')
        assert held(c, "Let me look." + CALL % "Paris") and held(c, CALL % "Oslo" + "\n" + CALL % "Paris")
        assert held(c, '<tool_call>\n{"name": "get_time", "arguments": {"zone": 5}}\n</tool_call>')
        assert not held(auto_constraint(tools, False, tok, answer), CALL % "Oslo" + "\n" + CALL % "Paris")
    assert not held(auto_constraint([{**WEATHER, "strict": True}], True, tok, answer), CALL % "Rome")
    after_thought = auto_constraint([WEATHER], True, tok, answer, "may_think")
    assert held(after_thought, '<think>Warm, I think.</think>\n\n{"temp": 21}')
    assert not held(after_thought, "<think>Warm, I think.</think>\n\nIt is warm.")


def test_a_model_that_does_not_think_gets_the_call_grammar_too(unthinking_tokenizer):
    """No think markers, so no reasoning rule (the grammar must not ask for them)."""
    tok = unthinking_tokenizer
    held = _held_by(tok)
    answer = {"type": "object", "properties": {"temp": {"type": "integer"}}, "required": ["temp"]}
    strict = auto_constraint([{**WEATHER, "strict": True}], True, tok, None, reasoning_state(tok, []))
    assert held(strict, "Let me look." + CALL % "Paris") and not held(strict, CALL % "Rome")
    either = auto_constraint([WEATHER], True, tok, answer, reasoning_state(tok, []))
    assert held(either, '{"temp": 21}') and held(either, CALL % "Oslo") and not held(either, "Warm.")


MISTRAL_CALL = '[TOOL_CALLS]get_weather[ARGS]{"city": "%s"}'
MISTRAL_LIST = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "%s"}}]'


@pytest.fixture(scope="module")
def mistral_tokenizers(mistral_model, tmp_path_factory):
    """Tokenizers of Mistral's call format (mlx-lm's `mistral` parser): "name[ARGS]{...}"
    with its markers as special tokens, as Mistral's tokenizers have them, or as text;
    and an older template's JSON list."""
    def tok(name, template, added):
        t = load_tokenizer(make_format_model(tmp_path_factory.mktemp(name) / "model", added, template))
        assert t.tool_parser.__module__ == "mlx_lm.tool_parsers.mistral" and t.tool_call_start == "[TOOL_CALLS]"
        return t
    return {"marker-tokens": load_tokenizer(mistral_model),
            "text-markers": tok("mistral-text", MISTRAL_TEMPLATE, ()),
            "list": tok("mistral-list", MISTRAL_LIST_TEMPLATE, ("[TOOL_CALLS]",))}


@pytest.mark.parametrize("kind", ["marker-tokens", "text-markers"])
def test_strict_auto_tools_in_mistrals_format(mistral_tokenizers, kind):
    """Mistral writes its calls after `[TOOL_CALLS]`, to the end of the text, each as
    `name[ARGS]{...}`: text before them is free, a call names a tool, a strict tool's
    arguments are held to its schema, and nothing but calls follows the first; what the
    grammar lets through, mlx-lm's parser reads as the calls."""
    tok = mistral_tokenizers[kind]
    held = _held_by(tok)
    strict = {**WEATHER, "strict": True}
    c = auto_constraint([strict, CLOCK], True, tok)
    assert ("<[" in c.grammar) == (kind == "marker-tokens")
    two = MISTRAL_CALL % "Oslo" + MISTRAL_CALL % "Paris"
    assert held(c, "No call here, only [ and [TOOL text.") and held(c, "Let me look." + MISTRAL_CALL % "Paris")
    assert held(c, two) and held(c, MISTRAL_CALL % "Oslo" + 'get_weather[ARGS]{"city": "Paris"}')
    assert held(c, '[TOOL_CALLS]get_time[ARGS]{"zone": 5}')                  # not strict: any object
    assert not held(c, MISTRAL_CALL % "Rome") and not held(c, MISTRAL_CALL.replace("weather", "news") % "Oslo")
    assert not held(c, MISTRAL_CALL % "Oslo" + " Done.")
    assert not held(auto_constraint([strict, CLOCK], False, tok), two)
    assert auto_constraint([WEATHER, CLOCK], True, tok) is None
    message, reason = ToolOutput("auto", tok, [strict, CLOCK]).message("Let me look." + two, "stop")
    assert reason == "tool_calls" and message["content"] == "Let me look."
    assert _plain(message["tool_calls"]) == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Paris"})]


def test_strict_auto_tools_in_mistrals_older_list(mistral_tokenizers):
    """A template without `[ARGS]` has its calls as one JSON list after `[TOOL_CALLS]`."""
    tok = mistral_tokenizers["list"]
    held = _held_by(tok)
    strict = {**WEATHER, "strict": True}
    c = auto_constraint([strict, CLOCK], True, tok)
    listed = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}, ' \
             '{"name": "get_time", "arguments": {"zone": "UTC"}}]'
    assert held(c, "Sure." + MISTRAL_LIST % "Paris") and held(c, listed) and held(c, "No call.")
    assert not held(c, MISTRAL_LIST % "Rome") and not held(c, MISTRAL_LIST % "Paris" + " Done.")
    assert not held(auto_constraint([strict, CLOCK], False, tok), listed)
    message, reason = ToolOutput("auto", tok, [strict, CLOCK]).message(listed, "stop")
    assert reason == "tool_calls" and _plain(message["tool_calls"]) == [("get_weather", {"city": "Oslo"}),
                                                                        ("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("kind", ["marker-tokens", "text-markers", "list"])
def test_mistral_auto_tools_with_a_response_format_give_calls_or_the_answer(mistral_tokenizers, kind):
    tok = mistral_tokenizers[kind]
    held = _held_by(tok)
    answer = {"type": "object", "properties": {"temp": {"type": "integer"}}, "required": ["temp"],
              "additionalProperties": False}
    call = (MISTRAL_LIST if kind == "list" else MISTRAL_CALL) % "Paris"
    for tools in ([WEATHER, CLOCK], [{**WEATHER, "strict": True}, CLOCK]):
        c = auto_constraint(tools, True, tok, answer)
        assert held(c, '{"temp": 21}') and held(c, ' {"temp": 21}') and held(c, call) and held(c, "Sure." + call)
        assert not held(c, '{"temp": "warm"}') and not held(c, "It is warm.") and not held(c, '{"temp": 21} more')
    assert not held(auto_constraint([{**WEATHER, "strict": True}], True, tok, answer), call.replace("Paris", "Rome"))


def test_tools_made_from_pydantic_models_keep_their_refs(tokenizer):
    """`openai.pydantic_function_tool` writes a nested model as `$defs` and `$ref`s
    pointing at the parameters' root. Inside the larger schema that holds several tools
    those pointers would miss ("required" and strict "auto" were a 400); they are
    rebased, and a call is held to the nested model."""
    class Loc(pydantic.BaseModel):
        city: Literal["Paris", "Oslo"]

    class Where(pydantic.BaseModel):
        loc: Loc
        near: Loc | None = None

    where = openai.pydantic_function_tool(Where)["function"]
    assert "$defs" in where["parameters"]
    held = _held_by(tokenizer)
    call = '<tool_call>\n{"name": "Where", "arguments": {"loc": {"city": "%s"}, "near": null}}\n</tool_call>'
    auto = auto_constraint([where, CLOCK], True, tokenizer)
    assert held(auto, call % "Oslo") and not held(auto, call % "Rome")
    required = constraint([where, CLOCK], "required", True)
    listed = '[{"name": "Where", "parameters": {"loc": {"city": "%s"}, "near": {"city": "Paris"}}}]'
    assert held(required, listed % "Paris") and not held(required, listed % "Rome")
    assert held(constraint([where], "Where", True), '{"loc": {"city": "Oslo"}, "near": null}')


def test_allowed_tools_hold_the_calls_to_the_listed_functions(tokenizer):
    """`tool_choice: {"type": "allowed_tools", ...}`: the template keeps every tool, and a
    call may name only the listed ones: under "auto" through the call grammar (no
    function strict), under "required" through the list constraint."""
    def body(mode, names):
        return ChatCompletionRequest.model_validate({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": f} for f in (WEATHER, CLOCK)],
            "tool_choice": {"type": "allowed_tools", "allowed_tools": {
                "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}})
    held = _held_by(tokenizer)
    auto = body("auto", ["get_time"])
    assert len(auto.tool_defs()) == 2 and [d["name"] for d in auto.callable_defs()] == ["get_time"]
    assert auto.tool_mode() == "auto" and auto.constraint() is None
    grammar = auto_constraint(auto.callable_defs(), True, tokenizer, None, "answer", auto.restricts_calls())
    clock = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert held(grammar, "Sure." + clock) and held(grammar, "No call.") and not held(grammar, CALL % "Paris")
    required = body("required", ["get_time"])
    assert required.forced_tool() == "required"
    assert held(required.constraint(), '[{"name": "get_time", "parameters": {"zone": "CET"}}]')
    assert not held(required.constraint(), '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert not body("auto", ["get_weather", "get_time"]).restricts_calls()
    with pytest.raises(pydantic.ValidationError, match="allows 'get_news'"):
        body("auto", ["get_news"])


def test_only_an_object_answer_goes_beside_the_calls():
    """The call grammar can offer an object answer beside the calls (OpenAI's formats
    are objects); another root leaves the response format holding the whole output."""
    def fmt(**f):
        return ResponseFormat.model_validate(f).object_schema()
    obj = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert fmt(type="json_object") == {"type": "object"} and fmt(type="text") is None
    assert fmt(type="json_schema", json_schema={"name": "a", "schema": obj}) == obj
    assert fmt(type="json_schema", json_schema={"name": "a", "schema": {"properties": {}}}) == {"properties": {}}
    assert fmt(type="json_schema", json_schema={"name": "a", "schema": {"type": "array"}}) is None


# gpt-oss's harmony turns: (text, whether calls are parsed, finish reason in, expected
# reasoning, content, calls, finish reason out).
_ANALYSIS = "<|channel|>analysis<|message|>They want the weather.<|end|>"
_CALL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}"
HARMONY_TURNS = [
    (_ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny, 20 C.", True, "stop",
     "They want the weather.", "Sunny, 20 C.", [], "stop"),
    (_ANALYSIS + _CALL, True, "stop", "They want the weather.", "", [("get_weather", {"city": "Oslo"})], "tool_calls"),
    # The recipient before the channel; a preamble first, as commentary without one.
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary "
     "json<|message|>{\"zone\": \"UTC\"}", True, "stop", "", "Checking.", [("get_time", {"zone": "UTC"})], "tool_calls"),
    # `<|constrain|>` right after the recipient, as OpenAI's guide writes it too.
    ("<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{\"city\": \"Oslo\"}", True, "stop",
     "", "", [("get_weather", {"city": "Oslo"})], "tool_calls"),
    # Without tools, a call's body is content; a built-in tool's call is reasoning.
    (_ANALYSIS + _CALL, False, "stop", "They want the weather.", "{\"city\": \"Oslo\"}", [], "stop"),
    ("<|channel|>analysis to=browser.search<|message|>{\"q\": \"oslo\"}<|end|><|start|>assistant<|channel|>final"
     "<|message|>Done.", True, "stop", "{\"q\": \"oslo\"}", "Done.", [], "stop"),
    # Cut by the token limit inside the reasoning, or inside a header.
    ("<|channel|>analysis<|message|>Thinking abo", True, "length", "Thinking abo", "", [], "length"),
    (_ANALYSIS + "<|start|>assistant<|chan", True, "length", "They want the weather.", "", [], "length"),
    # A turn that opens with its recipient, read as a call or, without tools, as content.
    (" to=functions.get_time<|channel|>commentary json<|message|>{\"zone\": \"UTC\"}", True, "stop", "", "",
     [("get_time", {"zone": "UTC"})], "tool_calls"),
    (" to=functions.get_time<|channel|>commentary json<|message|>{\"zone\": \"UTC\"}", False, "stop", "",
     "{\"zone\": \"UTC\"}", [], "stop"),
    # Not harmony's framing (held to JSON by a response format): content as it is, also
    # where the text ends before it can be told from a recipient.
    (" to", True, "length", "", " to", [], "length"),
    ("{\"city\": \"Oslo\"}", True, "stop", "", "{\"city\": \"Oslo\"}", [], "stop"),
    ("<|x", True, "stop", "", "<|x", [], "stop"),
]


@pytest.mark.parametrize("text, calls, reason_in, reasoning, content, expected_calls, reason", HARMONY_TURNS)
def test_harmony_turns_split_whole_and_in_any_pieces(text, calls, reason_in, reasoning, content, expected_calls,
                                                     reason):
    from deployments.harmony import HarmonyParser

    whole, got_reason = HarmonyParser(calls).message(text, reason_in)
    assert (whole.get("reasoning", ""), whole["content"] or "", got_reason) == (reasoning, content, reason)
    assert _plain(whole.get("tool_calls", [])) == expected_calls
    assert (whole["content"] is None) == bool(expected_calls and not content)
    for seed in range(20):
        parser, rng, got, i = HarmonyParser(calls), random.Random(seed), {"reasoning": "", "content": "",
                                                                           "tool_calls": []}, 0
        while i < len(text):
            n = rng.randint(1, 9)
            delta, out_reason = parser.feed(text[i:i + n], reason_in if i + n >= len(text) else None)
            for key, v in delta.items():
                got[key] += v
            i += n
        assert (got["reasoning"], got["content"], out_reason) == (reasoning, content, reason)
        assert _plain(joined_pieces(got["tool_calls"])) == expected_calls
        assert all("<|" not in v for v in (got["reasoning"], got["content"])) or content.startswith("<|")


@pytest.mark.parametrize("text, calls, reason_in, reasoning, content, expected_calls, reason", HARMONY_TURNS)
def test_harmony_output_text_logprobs_are_the_contents_tokens(harmony_model, text, calls, reason_in, reasoning,
                                                               content, expected_calls, reason):
    """Responses' `output_text` logprobs of a harmony turn: the entries of the tokens
    that wrote the content the parser reads, none of the framing's, the reasoning's or
    a call's, handed out with the content they wrote, however the tokens arrive."""
    from deployments.harmony import HarmonyParser, HarmonyTextLogprobs, harmony_markers

    tok = load_tokenizer(harmony_model)
    text_of = TokenText(tok)
    tokens = [(t, text_of.bytes_of(t), {"token": tok.decode([t]), "i": i})
              for i, t in enumerate(tok.encode(text, add_special_tokens=False))]
    assert b"".join(raw for _, raw, _ in tokens).decode() == text
    for seed in range(10):
        rng, parser, lps = random.Random(seed), HarmonyParser(calls), HarmonyTextLogprobs(harmony_markers(tok), calls)
        got, i = [], 0
        while i < len(tokens):
            n = rng.randint(1, 4)
            lps.add(tokens[i:i + n])
            delta, _ = parser.feed("".join(tok.decode([t]) for t, _, _ in tokens[i:i + n]),
                                   reason_in if i + n >= len(tokens) else None)
            got += lps.release(delta.get("content", ""))
            i += n
        got += lps.rest(bool(expected_calls))
        assert "".join(e["token"] for e in got) == content, seed
        assert [e["i"] for e in got] == sorted(e["i"] for e in got)


def test_a_harmony_models_format_holds_the_final_channel(harmony_model):
    """A response format for a harmony model: reasoning first or not, then the answer on
    the final channel, in the format; not the bare JSON, nor a second reasoning, nor
    another channel's answer."""
    from deployments.harmony import answer_constraint, harmony_markers

    tok = load_tokenizer(harmony_model)
    held, markers = _held_by(tok), harmony_markers(tok)
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER[
        "parameters"]}}).constraint()
    c = answer_constraint(markers, fmt)
    answer, think = '{"city": "Oslo"}', "<|channel|>analysis<|message|>Say Oslo.<|end|><|start|>assistant"
    assert c.param == "response_format"
    assert held(c, "<|channel|>final<|message|>" + answer) and held(c, think + "<|channel|>final<|message|>" + answer)
    assert not held(c, answer) and not held(c, think + think + "<|channel|>final<|message|>" + answer)
    assert not held(c, "<|channel|>final<|message|>" + '{"city": "Rome"}')
    assert not held(c, "<|channel|>commentary<|message|>" + answer)
    assert held(answer_constraint(markers, ResponseFormat(type="json_object").constraint()),
                "<|channel|>final<|message|>{}")


def test_a_harmony_model_is_shown_its_response_format():
    """A response format's schema goes into the developer message as OpenAI's harmony
    guide writes it (`# Response Formats`, the format's name, its description, the schema
    as compact JSON): after the instructions of a system or developer message put
    first, or in a system message of its own; the other messages as they were."""
    from deployments.harmony import show_format

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    section = '# Response Formats\n\n## city\n\n// A city.\n{"type":"object","properties":{"city":{"type":"string"}}}'
    user = {"role": "user", "content": "Where?"}
    assert show_format([user], "city", schema, "A city.") == [{"role": "system", "content": section}, user]
    for role in ("system", "developer"):
        head = {"role": role, "content": "Be brief.", "name": "ops"}
        assert show_format([head, user], "city", schema, "A city.") == [
            {**head, "content": "Be brief.\n\n" + section}, user]
        assert show_format([{**head, "content": ""}, user], "city", schema, "A city.")[0]["content"] == section
    later = [user, {"role": "system", "content": "Late."}]
    assert show_format(later, "c", None) == [
        {"role": "system", "content": '# Response Formats\n\n## c\n\n{"type":"object"}'}, *later]


def test_harmony_auto_tools_hold_strict_calls_or_the_answer(harmony_model):
    """Under "auto", a harmony model with a strict function (or an answer format, or
    allowed tools) may reason and write a preamble, free, then call one of the tools,
    in either header order, a strict one's arguments held to its schema, or answer on
    the final channel (free, or in the format). Nothing strict or formatted: no grammar."""
    from deployments.harmony import auto_constraint as harmony_auto, harmony_markers

    tok = load_tokenizer(harmony_model)
    held, markers = _held_by(tok), harmony_markers(tok)
    tools = [{**WEATHER, "strict": True}, CLOCK]
    c = harmony_auto(tools, markers)
    think = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant"
    say = "<|channel|>commentary<|message|>On it.<|end|><|start|>assistant"
    weather = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + '{"city": "%s"}'
    assert c.param == "tools" and held(c, think + weather % "Oslo") and held(c, say + weather % "Paris")
    assert held(c, ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "any", "x": 1}')
    for head in ("<|channel|>commentary to=functions.get_weather<|constrain|>json",   # OpenAI's guide's forms
                 "<|channel|>commentary to=functions.get_weather", " to=functions.get_weather<|channel|>commentary"):
        assert held(c, head + '<|message|>{"city": "Oslo"}'), head
    assert held(c, think + "<|channel|>final<|message|>Sunny.") and not held(c, weather % "Rome")
    assert not held(c, "<|channel|>commentary to=functions.get_news <|constrain|>json<|message|>{}")
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    formatted = harmony_auto([WEATHER, CLOCK], markers, answer)
    assert held(formatted, think + '<|channel|>final<|message|>{"ok": true}') and held(formatted, weather % "Rome")
    assert not held(formatted, "<|channel|>final<|message|>Sunny.")
    assert harmony_auto([WEATHER, CLOCK], markers) is None
    assert harmony_auto([WEATHER], markers, restricted=True) is not None
