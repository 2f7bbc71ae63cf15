"""gpt-oss's harmony format in /v1/chat/completions and /v1/responses.

gpt-oss writes its turn as messages, each `<|channel|>NAME[ to=RECIPIENT][ <|constrain|>json]
<|message|>BODY`, ended by `<|end|>` (the next one opens with `<|start|>assistant`, and
a recipient may stand before the channel), `<|call|>` (a tool call: the turn stops) or
`<|return|>` (the answer is done). Its markers are special tokens, so a harmony model's
text is decoded with them kept and read here: the `analysis` channel is the reasoning,
`final` the content, a message addressed `to=functions.NAME` a call of NAME with the
body as its arguments (where the request offered tools), other commentary content (a
preamble before calls, as OpenAI's models write). The stop tokens end generation and
never reach the text, so a call is told by its recipient, not by `<|call|>`.

A response format holds only the final channel's text, after reasoning left free
(`answer_constraint`), as vLLM holds only what follows a model's reasoning: held to JSON
from its first token, the model could not write its framing. A JSON schema is also shown
to the model in its developer message (`show_format`), which the grammar does not do.
Beside tools under "auto" (`auto_constraint`) the turn ends in a call or in the answer
in the format, and a strict function's arguments are held to its schema. Text that does
not open with harmony's framing (an output held to JSON by a forced tool choice) is
content as it is. `HarmonyTextLogprobs` tells the same content's tokens, for Responses'
output_text logprobs.

mlx-lm has no parser for this format; vLLM reads it with OpenAI's `openai_harmony`,
which fetches its vocabulary at run time, so this one works on the decoded text.
"""

import json
import re

from runtime.structured_output import StructuredOutputsParams

from .chat_output import ChoiceParser, partial_marker
from .responses import TextLogprobs
from .tools import FREE, call_arguments, json_rule, tool_call

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
# What the text of a harmony turn opens with: the first message's channel or recipient
# (the prompt ends in `<|start|>assistant`), or a new message.
OPENERS = ("<|channel|>", " to=", "<|start|>")
MARKERS = ("<|start|>", "<|channel|>", MESSAGE, "<|constrain|>", *ENDS)

_CHANNEL = re.compile(r"<\|channel\|>\s*([\w.-]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def harmony_markers(tokenizer) -> dict[str, int] | None:
    """Harmony's marker ids where the tokenizer's vocabulary has each as one token (a
    harmony model), else None. Read once, at start-up: the vocabulary comes as one dict
    of all of it (200k entries for gpt-oss)."""
    vocab = tokenizer.get_vocab()
    return {m: vocab[m] for m in MARKERS} if all(m in vocab for m in MARKERS) else None


def template_message(message: dict) -> dict:
    """A message as gpt-oss's template takes it: beside calls it shows one analysis text,
    the content or the reasoning, and refuses both (transformers passes the reasoning as
    `thinking` whatever its name), so a call's preamble gives way to its reasoning, which
    OpenAI's guide says to pass back for calls."""
    if message.get("tool_calls") and message.get("content") and message.get("reasoning_content"):
        return {**message, "content": ""}
    return message


def show_format(messages: list[dict], name: str, schema: dict | None, description: str | None = None) -> list[dict]:
    """Messages that show the model a response format (`name`, `schema`, `description`),
    as OpenAI's harmony guide asks: a `# Response Formats` section in the developer message,
    which the grammar alone (`answer_constraint`) does not tell the model. gpt-oss's
    template makes the first system or developer message's content that message's
    instructions, so the section ends that content (before the template's `# Tools`),
    or stands alone in a system message put first."""
    section = f"# Response Formats\n\n## {name}\n\n" + (f"// {description}\n" if description else "") \
        + json.dumps(schema if schema is not None else {"type": "object"}, separators=(",", ":"))
    if messages and messages[0]["role"] in ("system", "developer"):
        head = messages[0]
        return [{**head, "content": f"{head['content']}\n\n{section}" if head["content"] else section},
                *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def answer_constraint(markers: dict[str, int], fmt: StructuredOutputsParams) -> StructuredOutputsParams:
    """A response format's constraint (`fmt`: JSON, to a schema or any object) for a
    harmony model (`markers`: `harmony_markers`): reasoning first if the model will,
    free, on the analysis channel, then the answer on the final channel, held to the
    format."""
    schema = fmt.json if fmt.json is not None else {"type": "object"}
    schema = json.loads(schema) if isinstance(schema, str) else schema
    return _turn(markers, schema, [], fmt.param)


def auto_constraint(tools: list[dict], markers: dict[str, int], answer: dict | None = None,
                    restricted: bool = False) -> StructuredOutputsParams | None:
    """tool_choice "auto" for a harmony model (`markers`) where a function is strict, an answer
    format (`answer`, an object's schema) is given or the calls are `restricted` to
    `tools` (`allowed_tools`): the turn may reason first and write a preamble, free, then
    either one call of one of `tools` (its arguments held to a strict function's schema,
    any object otherwise), in either header order gpt-oss writes, or the answer on the
    final channel, in the format or free. None otherwise: the text is free."""
    if answer is None and not restricted and not any(t.get("strict") for t in tools):
        return None
    return _turn(markers, answer, tools, "tools")


def _turn(markers: dict[str, int], answer: dict | None, tools: list[dict],
          param: str) -> StructuredOutputsParams:
    """The grammar of a harmony turn: an analysis message, a preamble (with calls), then
    the final answer (`answer`: its schema; None: free text) or a call of one of `tools`."""
    ch, msg, end, start, constrain = (f"<[{markers[m]}]>" for m in
                                      ("<|channel|>", MESSAGE, "<|end|>", "<|start|>", "<|constrain|>"))
    rules = [f'analysis: {ch} "analysis" {msg} TEXT {end} {start} "assistant"',
             f'final: {ch} "final" {msg} {"answer" if answer is not None else "TEXT"}', f"TEXT: {FREE}"]
    if answer is not None:
        rules.append(json_rule("answer", answer))
    if not tools:
        return StructuredOutputsParams(grammar="\n".join(["start: analysis? final", *rules]), param=param)
    rules += [f'preamble: {ch} "commentary" {msg} TEXT {end} {start} "assistant"',
              "call: " + " | ".join(f"fn{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        to = f"to=functions.{t['name']}"
        typed = f'(" "? {constrain} "json")?'   # `<|constrain|>json` may follow, or may not
        head = f'({ch} "commentary {to}" {typed} | " {to}" {ch} "commentary" (" json" | {typed}))'
        rules.append(json_rule(f"fn{i}", call_arguments(t), f"{head} {msg} "))
    return StructuredOutputsParams(grammar="\n".join(["start: analysis? (final | preamble? call)", *rules]),
                                   param=param)


def route(header: str, calls: bool) -> str:
    """Where the body of a message with `header` goes: "call" (addressed to
    `functions.*`, where `calls` are read), "reasoning" (the analysis channel, or a
    built-in tool's call, `browser.*` or `python`: the model's own work) or "content"."""
    channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
    to = recipient.group(1) if recipient else None
    if to and to.startswith("functions.") and calls:
        return "call"
    if (channel and channel.group(1) == "analysis") or (to and not to.startswith("functions.")):
        return "reasoning"
    return "content"


class HarmonyParser(ChoiceParser):
    """One choice's harmony text, whole or as it streams, as reasoning, content and tool
    calls in the order written. `calls`: whether messages to `functions.*` are tool calls
    (the request's tools under "auto"); otherwise their bodies are content."""

    def __init__(self, calls: bool = False):
        super().__init__()
        self.parse_calls = calls
        self.state = "open"     # "open": framing not yet told; "header"; "body"; "plain"
        self.pending = ""       # text held until it can be told
        self.route = "content"  # where the current body goes: a kind, or a call's index
        self.calls = 0

    def parts(self, delta: str, finish_reason: str | None) -> tuple[list[tuple[str, object]], str | None]:
        final = finish_reason is not None
        text, self.pending, out = self.pending + delta, "", []
        while text:
            if self.state == "open":
                if not final and any(o.startswith(text) for o in OPENERS):
                    self.pending = text
                    break
                self.state = "header" if text.startswith(OPENERS) else "plain"
            if self.state == "plain":
                out.append(("content", text))
                break
            if self.state == "header":
                at = text.find(MESSAGE)
                if at < 0:
                    self.pending = "" if final else text   # a header cut off says nothing
                    break
                out += self._open(text[:at])
                text, self.state = text[at + len(MESSAGE):], "body"
                continue
            ends = [(i, m) for m in ENDS if (i := text.find(m)) >= 0]
            if ends:
                at, marker = min(ends)
                out += self._body(text[:at])
                text, self.state = text[at + len(marker):], "header"
                continue
            keep = 0 if final else max(partial_marker(text, m) for m in ENDS)
            out += self._body(text[:len(text) - keep])
            self.pending = text[len(text) - keep:]
            break
        if final and self.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return [(kind, v) for kind, v in out if v], finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole message: what streaming the text in one piece joins up (`feed`)."""
        out, finish_reason = self.feed(text, finish_reason or "stop")
        message = {"role": "assistant", **({"reasoning": out["reasoning"]} if "reasoning" in out else {})}
        calls = [{k: v for k, v in c.items() if k != "index"} for c in out.get("tool_calls", [])]
        if not calls:
            return {**message, "content": out.get("content", "")}, finish_reason
        return {**message, "content": out.get("content") or None, "tool_calls": calls}, finish_reason

    def _open(self, header: str) -> list[tuple[str, object]]:
        """A message's header read: where its body goes; a call's opening piece."""
        self.route = route(header, self.parse_calls)
        if self.route == "call":
            self.route, self.calls = self.calls, self.calls + 1
            name = _RECIPIENT.search(header).group(1).removeprefix("functions.")
            return [("tool_calls", [tool_call(name, "", self.route)])]
        return []

    def _body(self, text: str) -> list[tuple[str, object]]:
        if not text:
            return []
        if isinstance(self.route, int):
            return [("tool_calls", [{"index": self.route, "function": {"arguments": text}}])]
        return [(self.route, text)]


class HarmonyTextLogprobs(TextLogprobs):
    """Which tokens of a harmony turn wrote its output text, for Responses' `output_text`
    logprobs: the bodies of the messages `HarmonyParser` makes content (`route`), or every
    token of a text without harmony's framing, as the parser reads it. The markers are
    single tokens, so the framing is told token by token and none of it is text."""

    def __init__(self, markers: dict[str, int], calls: bool = False):
        super().__init__(None, "")
        self.marker = {i: m for m, i in markers.items()}
        self.calls = calls
        self.mode = "open"      # "open" (framing not yet told: `held`), "header", "body", "plain"
        self.held: list[tuple[int, str, dict]] = []
        self.header, self.body = "", "content"

    def add(self, tokens: list[tuple[int, bytes, dict]]) -> None:
        for token in self.texts(tokens):
            if self.mode == "open":
                self.held.append(token)
                text = "".join(piece for _, piece, _ in self.held)
                if not any(o.startswith(text) for o in OPENERS):
                    self._tell(text)
                continue
            self._read(token)

    def release(self, content: str) -> list[dict]:
        if content and self.mode == "open":   # the parser told it at the end: no framing
            self._tell("".join(piece for _, piece, _ in self.held))
        return super().release(content)

    def _tell(self, text: str) -> None:
        self.mode = "header" if text.startswith(OPENERS) else "plain"
        held, self.held = self.held, []
        for token in held:
            self._read(token)

    def _read(self, token: tuple[int, str, dict]) -> None:
        t, piece, entry = token
        marker = self.marker.get(t)
        if self.mode == "plain" or (self.mode == "body" and marker is None and self.body == "content"):
            self.text_token(piece, entry)
        elif self.mode == "header":
            if marker == MESSAGE:
                self.mode, self.body, self.header = "body", route(self.header, self.calls), ""
            else:
                self.header += piece
        elif marker in ENDS:
            self.mode = "header"
