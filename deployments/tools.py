"""Tool calls in /v1/chat/completions: what constrains the output, and how the text the
model wrote becomes OpenAI `tool_calls`.

- `tool_choice: "required"` or a named function: the output is held to JSON (structured
  outputs) that the calls are read from, so it works with any model: for a named
  function, its arguments; for "required", a list of `{"name", "parameters"}` objects,
  one per call, each naming one of the tools (vLLM does the same).
- `"auto"`: the model writes calls in its own format, between the markers that
  mlx-lm's tokenizer knows for its family (`tool_call_start`, `tool_call_end`), and
  mlx-lm's parser for that family reads them. Text outside the markers is the
  message's content. A model without such a parser cannot do "auto". Where the family
  writes its calls as JSON (mlx-lm's `json_tools`: Qwen, Hermes, between markers; its
  `mistral`: after `[TOOL_CALLS]`), a grammar (`auto_constraint`) holds each call to one
  of the functions, a strict one's arguments to its schema, when a function is `strict`
  or the answer has a `response_format`: the text is free, or, with a response format,
  either one or more calls or the answer in that format (OpenAI's behaviour; a response
  format alone would rule every call out). gpt-oss's harmony format has its own such
  grammar (`harmony.auto_constraint`). In other formats `strict` is not enforced under
  "auto", as in vLLM, and a response format holds the whole output.
- `allowed_tools`: every tool is shown to the template, and calls may name only the
  listed ones: "required" as above over those; "auto" through `auto_constraint`'s
  grammar (other formats: not enforced).
- `"none"`: the tools are shown to the chat template, and nothing is parsed.
"""

import json
import logging
import re
import uuid

from runtime.structured_output import JSON_OPTIONS, StructuredOutputsParams

from .chat_output import joined_pieces, partial_marker

log = logging.getLogger("ray.serve")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, index: int | None = None) -> dict:
    call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


# The next call of a "required" list, up to where its parameters begin (the constraint's
# compact JSON: ", " and ": " between items).
_REQUIRED_CALL = re.compile(r'(?:\}?(?:, |\[))\{"name": "((?:[^"\\]|\\.)*)", "parameters": ')


def _parameters(tool: dict) -> dict:
    return tool.get("parameters") or {"type": "object", "properties": {}}


def constraint(tools: list[dict], choice: str | None, parallel: bool) -> StructuredOutputsParams | None:
    """The structured output a forced choice needs; `choice`: "required" or a function's
    name (None for "auto" and "none"). `tools`: the request's function definitions."""
    if choice is None:
        return None
    if choice != "required":
        tool = next(t for t in tools if t["name"] == choice)
        return StructuredOutputsParams(json=_parameters(tool), param="tools")
    return StructuredOutputsParams(json=_call_list(tools, [_parameters(t) for t in tools], "parameters", parallel),
                                   param="tools")


def _call_objects(tools: list[dict], schemas: list[dict], key: str, **extra) -> tuple[list[dict], dict]:
    """One object schema per tool, `{"name": its name, key: its schema}` (`extra`: optional
    properties besides), and the root keys (`$defs`) the schema holding them needs."""
    placed, defs = _placed(schemas)
    return [{"type": "object", "properties": {"name": {"const": t["name"]}, key: s, **extra},
             "required": ["name", key], "additionalProperties": False} for t, s in zip(tools, placed)], defs


def _call_list(tools: list[dict], schemas: list[dict], key: str, parallel: bool, **extra) -> dict:
    """A JSON list of such objects: one at least, one at most without `parallel`."""
    objects, defs = _call_objects(tools, schemas, key, **extra)
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": objects}, **defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _placed(schemas: list[dict]) -> tuple[list[dict], dict]:
    """Parameter schemas as they sit inside one larger schema, and the root keys that
    schema needs: a JSON pointer is read from the root of the whole schema, so a schema
    with local `$ref`s (pydantic writes `$defs` for nested models) moves under the root's
    `$defs`, its pointers rebased there."""
    placed, defs = [], {}
    for i, schema in enumerate(schemas):
        if '"$ref"' not in json.dumps(schema):
            placed.append(schema)
            continue
        defs[f"tool{i}"] = _rebased(schema, f"#/$defs/tool{i}")
        placed.append({"$ref": f"#/$defs/tool{i}"})
    return placed, ({"$defs": defs} if defs else {})


def _rebased(node, base: str):
    if isinstance(node, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    return node


JSON_TOOLS = "mlx_lm.tool_parsers.json_tools"   # JSON between markers (Qwen, Hermes)
MISTRAL = "mlx_lm.tool_parsers.mistral"         # [TOOL_CALLS], then the calls to the end
FREE = "/(.|\\n)*/"                                # any text, in the grammar's terms
NOT_AN_OBJECT = r"/(\s*|\s*[^{\s](.|\n)*)/"       # text that does not open a JSON object


def auto_constraint(tools: list[dict], parallel: bool, tokenizer, answer: dict | None = None,
                    reasoning: str = "answer", restricted: bool = False) -> StructuredOutputsParams | None:
    """For tool_choice "auto" in a format whose calls are JSON: each call (one at most
    without `parallel`) names one of the tools, a strict one's arguments held to its
    schema, another's to any object; before the calls, free text. JSON between markers
    (`json_tools`): `{"name": ..., "arguments": ...}` between the markers, with free
    text around and between the calls. Mistral: the calls after `[TOOL_CALLS]` to the
    end of the text (`_mistral_calls`). With `answer` (the response format's JSON
    schema), the output is either that (one call at least) or the answer alone, in the
    schema. `tools`: those a call may name; `restricted`: the request's other tools are
    left out of them (`allowed_tools`). None where no function is strict, no answer
    format is given and nothing is left out, or where the model's format is another.

    A marker the tokenizer adds whole is matched as that token; one written as text ends
    the free text lazily, and the text after the last call may not contain it. The
    grammar holds the whole text, so a thinking model's reasoning comes first, free, as
    `reasoning` (`reasoning_state` of the prompt) says it may or must."""
    fmt = getattr(tokenizer.tool_parser, "__module__", None)
    if fmt not in (JSON_TOOLS, MISTRAL) or (
            answer is None and not restricted and not any(t.get("strict") for t in tools)):
        return None
    start = _marker(tokenizer, tokenizer.tool_call_start)
    if fmt == JSON_TOOLS:
        calls, defs = _call_objects(tools, [call_arguments(t) for t in tools], "arguments")
        end = _marker(tokenizer, tokenizer.tool_call_end)
        rules = [f"call: head NL fn NL {end}", _until(start, "head"), "NL: /\\n?/",
                 json_rule("fn", {"anyOf": calls, **defs})]
        plain, after = f"call{'*' if parallel else '?'} TEXT", f"NL fn NL {end}{' call*' if parallel else ''} TEXT"
    else:
        rules, plain, after = _mistral_calls(tokenizer, tools, parallel, start), "TEXT | head calls", "calls"
        if answer is None:
            rules.append(_until(start, "head"))
    body = plain if answer is None else f"lead {after} | answer"
    rules.insert(0, f"body: {body}")
    if answer is not None:   # text before the first call cannot open the answer's object:
                             # llguidance's lexer would follow the text and lose the answer
        rules += [_until(start, "lead", NOT_AN_OBJECT), json_rule("answer", answer, "/\\s*/ ")]
    if "TEXT" in body:
        text = FREE if start.startswith("<") else f"{FREE} & ~/(?s:.*){_regex(tokenizer.tool_call_start)}(?s:.*)/"
        rules.append(f"TEXT: {text}")
    opening = ""
    if reasoning != "answer" and getattr(tokenizer, "has_thinking", False):
        rules.append(_until(_marker(tokenizer, tokenizer.think_end), "thought"))
        opening = "thought " if reasoning == "thinking" else f"({_marker(tokenizer, tokenizer.think_start)} thought)? "
    return StructuredOutputsParams(grammar="\n".join([f"start: {opening}body", *rules]), param="tools")


def _mistral_calls(tokenizer, tools: list[dict], parallel: bool, start: str) -> list[str]:
    """The rules of Mistral's `calls`, which run from `[TOOL_CALLS]` to the end of the
    text. Newer templates (those that write `[ARGS]`) give each call as `name[ARGS]{...}`
    after a `[TOOL_CALLS]` of its own; older ones one JSON list of `{"name": ...,
    "arguments": ...}` objects (each may carry its `id`), as mlx-lm's parser reads either."""
    if "[ARGS]" not in (getattr(tokenizer, "chat_template", None) or ""):
        listed = _call_list(tools, [call_arguments(t) for t in tools], "arguments", parallel, id={"type": "string"})
        return [json_rule("calls", listed, "/\\s*/ ")]
    sep = _marker(tokenizer, "[ARGS]")
    rules = [f"calls: fn{f' ({start}? fn)*' if parallel else ''}",
             "fn: " + " | ".join(f"fn{i}" for i in range(len(tools)))]
    rules += [json_rule(f"fn{i}", call_arguments(t), f"{json.dumps(t['name'])} {sep} ") for i, t in enumerate(tools)]
    return rules


def call_arguments(tool: dict) -> dict:
    """What a call's arguments are held to: a strict tool's parameters, else any object."""
    return _parameters(tool) if tool.get("strict") else {"type": "object"}


def json_rule(rule: str, schema: dict, lead: str = "") -> str:
    return f"{rule}: {lead}%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def _until(marker: str, rule: str, text: str = FREE) -> str:
    """A rule for `text` up to a marker: an added token, which text cannot write, or a
    marker written as text, which ends the text lazily."""
    return f"{rule}{'' if marker.startswith('<') else '[lazy]'}: {text} {marker}"


def _marker(tokenizer, text: str) -> str:
    """A call marker as the grammar names it: `<[id]>` for a token the tokenizer adds
    whole (Qwen's markers; llguidance treats every such token as special, whatever its
    `special` flag says, so text cannot spell it), else a string literal."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and ids[0] in getattr(tokenizer, "added_tokens_decoder", {}):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def _regex(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


class ToolOutput:
    """Turns one completion's text into a chat message's `content` and `tool_calls`, whole
    or as it streams. `mode`: "auto", "required" or a function's name."""

    def __init__(self, mode: str, tokenizer=None, tools: list[dict] | None = None):
        self.mode, self.tools = mode, tools
        if mode == "auto":
            self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end or None
            self.parse = tokenizer.tool_parser
        self.text = ""        # all the text so far
        self.done = 0         # how much of it has been handed out or parsed
        self.calls = 0        # tool calls handed out
        self.streamed = False
        self.depth = None     # "required": nesting inside the current call's parameters
        self.in_string = self.escaped = False

    # -- whole ------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole message for a finished completion, and its finish reason: what
        streaming would send, each call's pieces joined."""
        content, pieces = self.feed(text)
        more, more_pieces = self.close()
        calls = [{k: v for k, v in c.items() if k != "index"} for c in joined_pieces(pieces + more_pieces)]
        message = {"role": "assistant", "content": (content + more) or None}
        if calls:
            message["tool_calls"] = calls
        return message, self.finish_reason(finish_reason)

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" when the model chose to call (OpenAI gives "stop" for a named
        function it was made to call); a cut by length stays "length"."""
        if reason == "stop" and self.calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    # -- streamed ---------------------------------------------------------------------
    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """New text in; the content that can go out now and any calls completed."""
        self.text += delta
        if self.mode == "auto":
            return self._auto(final=False)
        if self.mode == "required":
            return "", self._required()
        # A named function: the text is its arguments, streamed as OpenAI streams them.
        calls = []
        if not self.streamed:
            calls.append(tool_call(self.mode, "", 0))
            self.streamed = True
        new, self.done = self.text[self.done:], len(self.text)
        if new:
            calls.append({"index": 0, "function": {"arguments": new}})
        return "", calls

    def close(self) -> tuple[str, list[dict]]:
        """At the end of the completion: what is left."""
        if self.mode == "auto":
            return self._auto(final=True)
        if self.mode == "required":
            return "", []
        return "", [] if self.streamed else [tool_call(self.mode, self.text, 0)]

    def _required(self) -> list[dict]:
        """The list the constraint holds the text to, `[{"name": ..., "parameters": {...}},
        ...]`, read as it grows: a call's header once its name is whole, then its
        parameters object as argument pieces, up to the brace that closes it."""
        out = []
        while True:
            if self.depth is None:   # between calls: wait for the next one's name
                m = _REQUIRED_CALL.match(self.text, self.done)
                if m is None:
                    return out
                out.append(tool_call(json.loads(f'"{m.group(1)}"'), "", self.calls))
                self.calls += 1
                self.done, self.depth, self.in_string, self.escaped = m.end(), 0, False, False
            start, i, text = self.done, self.done, self.text
            while i < len(text) and self.depth is not None:
                ch = text[i]
                i += 1
                if self.in_string:
                    self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
                elif ch == '"':
                    self.in_string = True
                elif ch in "{[":
                    self.depth += 1
                elif ch in "}]":
                    self.depth -= 1
                    if self.depth == 0:
                        self.depth = None   # the parameters are whole
            if i > start:
                out.append({"index": self.calls - 1, "function": {"arguments": text[start:i]}})
            self.done = i
            if self.depth is not None:
                return out

    def _auto(self, final: bool) -> tuple[str, list[dict]]:
        """Content before a start marker goes out, except a tail that may be the start of
        one; a call goes out once its end marker (or, for formats without one, the end
        of the text) is there."""
        content, calls = "", []
        while True:
            rest = self.text[self.done:]
            at = rest.find(self.start)
            if at < 0:
                keep = 0 if final else partial_marker(rest, self.start)
                content += rest[:len(rest) - keep]
                self.done += len(rest) - keep
                return content, calls
            content += rest[:at]
            body_from = at + len(self.start)
            stop = rest.find(self.end, body_from) if self.end else -1
            if stop < 0 and not final:
                self.done += at
                return content, calls
            body = rest[body_from:stop] if stop >= 0 else rest[body_from:]
            self.done += (stop + len(self.end)) if stop >= 0 else len(rest)
            calls += self._parsed(body)

    def _parsed(self, body: str) -> list[dict]:
        try:
            parsed = self.parse(body, self.tools)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("a tool call could not be parsed (%s: %s); it was likely cut short",
                        type(e).__name__, e)
            return []
        out = []
        for c in parsed if isinstance(parsed, list) else [parsed]:
            args = c.get("arguments", {})
            out.append(tool_call(c["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                                 self.calls))
            self.calls += 1
        return out
