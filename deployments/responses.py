"""OpenAI's Responses API (`POST /v1/responses`) over the chat pipeline.

A request's `instructions` and `input` items become chat messages, its function tools
chat tools and its `text.format` a `response_format`, so the same template, constraints
and tool and reasoning parsing serve both endpoints. The choice's reasoning, text and
tool calls come back as output items: whole, or as the API's stream of typed events
(`ResponseEvents`). A response made with `store` (the default) is kept by the app's
store (response_store.py) with the items it was made from, so `previous_response_id`
can continue it: its items, then its output, come before the request's own input. A
request in a `conversation` (conversation_store.py) reads the conversation's items
before its own input in the same way, and adds its input and output to it when done.
"""

import time
import uuid
from collections import deque
from typing import Annotated, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from .logprobs import utf8_reader
from .protocol import Bookkeeping, Effort, _Strict, refused

TEXT_LOGPROBS = "message.output_text.logprobs"


class _Item(_Strict):
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class InputText(_Strict):
    """Text of a message: `input_text` from a client, `output_text` handed back from a
    response (its annotations and logprobs are accepted and dropped)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


def _by_type(default: str | None = None) -> Discriminator:
    """Picks a union's member by the input's `type` (`default` where it has none, as a
    message item may), so a bad item is checked against the member it names alone, and
    an unknown type is named in the error."""
    return Discriminator(lambda v: v.get("type", default) if isinstance(v, dict) else getattr(v, "type", default))


ContentPart = Annotated[Union[Annotated[InputText, Tag("input_text")], Annotated[InputText, Tag("output_text")],
                              Annotated[Refusal, Tag("refusal")]], _by_type()]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, InputText))


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Item):
    """A reasoning item handed back: its text goes to the template with the assistant
    turn that follows it, as a chat message's `reasoning` does."""

    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or [])


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], _by_type("message")]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class AllowedFunctions(_Strict):
    """The functions a call may name (chat's `allowed_tools`, flat as Responses has it)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[FunctionChoice] = Field(min_length=1)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema(self):
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema is required with type 'json_schema', and only with it")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ConversationRef(_Strict):
    id: str


class ReasoningConfig(_Strict):
    """`effort` reaches the chat template as `reasoning_effort`, as the chat endpoint's
    field does; a summary is never made (reasoning comes back whole)."""

    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


NoStoredPrompt = refused("stored prompts are not supported: send input and instructions")


class ResponsesStreamOptions(_Strict):
    """`include_obfuscation` pads OpenAI's delta events against length side channels;
    accepted, and the events here carry no padding."""

    include_obfuscation: bool | None = None


class ResponsesRequest(Bookkeeping):
    model: str
    input: Union[str, list[InputItem]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, AllowedFunctions, None] = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[Literal["reasoning.encrypted_content", "message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    previous_response_id: str | None = None
    conversation: Union[str, ConversationRef, None] = None
    background: bool = False
    max_tool_calls: int | None = Field(default=None, ge=1)   # caps built-in tool calls, of which there are none here
    stream_options: ResponsesStreamOptions | None = None
    prompt: NoStoredPrompt = None

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        if self.previous_response_id is not None and self.conversation is not None:
            raise ValueError("previous_response_id and conversation are mutually exclusive: give one of them")
        if self.background and self.store is False:
            raise ValueError("a background response is read back from the store: store must not be false")
        if self.background and self.stream:
            raise ValueError("a background response is not streamed here: poll GET /v1/responses/{id}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stored(self) -> bool:
        """Whether the response is to be kept: OpenAI's default, unless `store: false`."""
        return self.store is not False

    @property
    def conversation_id(self) -> str | None:
        c = self.conversation
        return c if isinstance(c, str) or c is None else c.id

    def input_items(self) -> list[dict]:
        """The input as items a store keeps and lists back (`stored_items`)."""
        return stored_items([MessageItem(role="user", content=self.input)] if isinstance(self.input, str)
                            else self.input)

    def turn_starts(self) -> list[int]:
        """Where the input's turns begin (its user messages): where `truncation: "auto"`
        may cut the conversation, so no call loses its output nor reasoning its answer."""
        return [i for i, item in enumerate(self.input)
                if isinstance(item, MessageItem) and item.role == "user"] if isinstance(self.input, list) else [0]

    def with_input(self, items: list[dict]) -> "ResponsesRequest":
        """This request with `items` as its input (a stored conversation, then its own)."""
        return ResponsesRequest.model_validate(
            {**self.model_dump(by_alias=True, exclude_unset=True), "input": items})

    @property
    def wants_logprobs(self) -> bool:
        """Whether output_text carries logprobs: only when `include` asks, as OpenAI's
        API answers (`top_logprobs` alone gives none)."""
        return TEXT_LOGPROBS in (self.include or ())

    def chat_body(self) -> dict:
        """The same request as a chat completion's body (`ChatCompletionRequest`)."""
        body = {"model": self.model, "messages": self.messages(), "temperature": self.temperature,
                "top_p": self.top_p, "stream": self.stream, "parallel_tool_calls": self.parallel_tool_calls}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif isinstance(self.tool_choice, AllowedFunctions):
            body["tool_choice"] = {"type": "allowed_tools", "allowed_tools": {
                "mode": self.tool_choice.mode,
                "tools": [{"type": "function", "function": {"name": t.name}} for t in self.tool_choice.tools]}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "description": fmt.description, "schema": fmt.schema_,
                "strict": fmt.strict}}
        if self.user is not None:
            body["user"] = self.user
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.wants_logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        return body

    def messages(self) -> list[dict]:
        """`instructions` as the system message, then the items as chat messages: a
        function call joins the assistant turn before it (or opens one), its output
        becomes a tool message, and reasoning goes with the assistant turn after it."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        reasoning = ""
        for item in items:
            last = out[-1] if out else None
            if isinstance(item, ReasoningItem):
                reasoning += item.text()
            elif isinstance(item, MessageItem):
                m = {"role": item.role, "content": item.text()}
                if item.role == "assistant" and reasoning:
                    m["reasoning"], reasoning = reasoning, ""
                out.append(m)
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if last is None or last["role"] != "assistant" or reasoning:
                    last = {"role": "assistant", "content": ""}
                    if reasoning:
                        last["reasoning"], reasoning = reasoning, ""
                    out.append(last)
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out

    def echo(self, stored: bool) -> dict:
        """The request's settings, as a response repeats them; `stored`: whether it is kept."""
        fmt = self.text.format if self.text and self.text.format else TextFormat(type="text")
        choice = self.tool_choice or ("auto" if self.tools else "none")
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "reasoning": (self.reasoning or ReasoningConfig()).model_dump(exclude={"generate_summary"}),
            "store": stored, "metadata": self.metadata or {}, "previous_response_id": self.previous_response_id,
            "truncation": self.truncation or "disabled", "user": self.user, "background": self.background,
            "conversation": None if self.conversation_id is None else {"id": self.conversation_id},
        }


def stored_items(items: list) -> list[dict]:
    """Input items as a store keeps and lists them back: each with an id (a new one
    where it has none) and a status, a message's text as content parts."""
    out = []
    for item in items:
        d = item.model_dump(exclude_none=True)
        d.setdefault("id", _id(_ITEM_ID_PREFIX[d["type"]]))
        if d["type"] != "reasoning":
            d.setdefault("status", "completed")
        if d["type"] == "message" and isinstance(d["content"], str):
            kind = "output_text" if d["role"] == "assistant" else "input_text"
            d["content"] = [{"type": kind, "text": d["content"]}]
        out.append(d)
    return out


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def usage(prompt: int, output: int, cached: int, reasoning: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output}


def reasoning_tokens(token_ids: list[int], end: list[int] | None, reasoned: bool) -> int:
    """The output tokens up to and including the first `end` (the token or tokens that
    end the reasoning; all of them if it never ended); 0 for an answer without reasoning."""
    if not reasoned:
        return 0
    n = len(end or ())
    for i in range(len(token_ids) - n + 1 if n else 0):
        if token_ids[i:i + n] == end:
            return i + n
    return len(token_ids)


class ResponseBody:
    """One response's envelope: its id, creation time and the request's settings."""

    def __init__(self, request: ResponsesRequest, model: str, stored: bool = False):
        self.id, self.created_at = _id("resp"), int(time.time())
        self.model, self.settings = model, request.echo(stored)

    def body(self, status: str, output: list[dict], usage_: dict | None = None, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": incomplete, "model": self.model, "output": output,
                "usage": usage_, **self.settings}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str | None, status: str, logprobs: list[dict] | None = None) -> dict:
    content = [] if text is None else [_text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}


class TextLogprobs:
    """Which generated tokens wrote a response's output text, for its logprobs: not the
    reasoning (told by the model's one-token think markers, as the grammar tells it,
    `runtime.structured_output.think_markers`), nor the markers, nor a tool call's
    markup after the text. A text token's entry goes out once the content handed out
    covers its text, so a stream's deltas carry the entries of their own text, and
    what a tool call's parse keeps out of the content keeps its tokens out too."""

    def __init__(self, think: tuple[int, int] | None, state: str):
        """`think`: the start and end marker ids; `state`: `reasoning_state` of the prompt."""
        self.start, self.end = think or (None, None)
        self.state = "thinking" if state == "thinking" else "before"
        # Text not yet covered by the content handed out: (its length, its tokens' entries).
        self.pending: deque[tuple[int, list[dict]]] = deque()
        self.room = 0                 # content handed out past the entries released
        self._begun: list[dict] = []  # tokens of a character not yet complete
        self._utf8 = utf8_reader()

    def texts(self, tokens: list[tuple[int, bytes, dict]]):
        """(id, the text it completes, entry) for each of (id, its bytes, entry): a
        character split across tokens is the text of the one that completes it."""
        for t, raw, entry in tokens:
            yield t, self._utf8(raw), entry

    def add(self, tokens: list[tuple[int, bytes, dict]]) -> None:
        """New tokens, each as (id, its bytes, logprob entry) (`LogprobFormat.with_bytes`)."""
        for t, piece, entry in self.texts(tokens):
            if self.state == "thinking":
                if t == self.end:
                    self.state = "after"
            elif self.state == "before" and t == self.start:
                self.state = "thinking"
            else:
                self.text_token(piece, entry)

    def text_token(self, text: str, entry: dict) -> None:
        """A token of the output text, held until the content covers what it wrote; one
        that begins a character goes out with the token that completes it."""
        self._begun.append(entry)
        if text:
            self.pending.append((len(text), self._begun))
            self._begun = []

    def release(self, content: str) -> list[dict]:
        """The entries of the text tokens that content handed out so far covers."""
        self.room += len(content)
        out = []
        while self.pending and self.pending[0][0] <= self.room:
            n, entries = self.pending.popleft()
            self.room -= n
            out += entries
        return out

    def rest(self, called: bool) -> list[dict]:
        """At the end: the entries still held (an end-of-sequence token's, say), unless a
        tool call followed the text, whose markup they are."""
        out = [] if called else [e for _, entries in self.pending for e in entries] + self._begun
        self.pending.clear()
        self._begun = []
        return out


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseEvents:
    """The stream of one response: `opening()`, then `feed(parts)` with each chunk's
    pieces in order (`ChoiceParser.parts`: reasoning, content, tool calls), then
    `closing(finish_reason, usage)`. Each output item opens when its first piece comes
    and is done when the next kind begins or the response ends; every event carries
    the next `sequence_number`. A whole response is the same events made of the whole
    text in one piece (`whole_response`), so the two agree however the text was cut.
    With `logprobs`, each piece of content carries its tokens' entries."""

    def __init__(self, envelope: ResponseBody, logprobs: TextLogprobs | None = None):
        self.envelope, self.logprobs = envelope, logprobs
        self.seq = 0
        self.items: list[dict] = []       # finished output items
        self.open: dict | None = None     # the item being streamed: its kind, id and text so far
        self.reasoned = self.called = False   # whether any reasoning, any tool call came

    def _event(self, type_: str, **fields) -> dict:
        ev = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def opening(self) -> list[dict]:
        body = self.envelope.body("in_progress", [])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def feed(self, parts: list[tuple[str, object]]) -> list[dict]:
        """A chunk's pieces in the order written (`ChoiceParser.parts`)."""
        events = []
        for kind, value in parts:
            if kind == "reasoning":
                self.reasoned = True
                events += self._text("reasoning", value)
            elif kind == "content":
                events += self._text("message", value, self.logprobs.release(value) if self.logprobs else None)
            else:
                self.called = True
                for call in value:
                    events += self._call(call)
        return events

    def closing(self, finish_reason: str | None, usage_: dict) -> list[dict]:
        """The text entries still held at the end (`TextLogprobs.rest`) go on the message."""
        tail = self.logprobs.rest(self.called) if self.logprobs else None
        events = self._text("message", "", tail) if tail else []
        events += self._close(finish_reason)
        if not any(i["type"] != "reasoning" for i in self.items):   # no text: an empty message, as whole
            events += self._text("message", "") + self._close(finish_reason)
        status = "incomplete" if finish_reason == "length" else "completed"
        body = self.envelope.body(status, self.items, usage_)
        return events + [self._event(f"response.{status}", response=body)]

    def _index(self) -> int:
        return len(self.items)

    def _text(self, kind: str, text: str, logprobs: list[dict] | None = None) -> list[dict]:
        events = []
        if self.open is None or self.open["kind"] != kind:
            events += self._close(None)
            item_id = _id("rs" if kind == "reasoning" else "msg")
            self.open = {"kind": kind, "id": item_id, "text": "", "logprobs": []}
            if kind == "reasoning":
                events.append(self._event("response.output_item.added", output_index=self._index(),
                                          item=_reasoning_item(item_id, None, "in_progress")))
                events.append(self._event("response.content_part.added", item_id=item_id,
                                          output_index=self._index(), content_index=0,
                                          part={"type": "reasoning_text", "text": ""}))
            else:
                events.append(self._event("response.output_item.added", output_index=self._index(),
                                          item=_message_item(item_id, None, "in_progress")))
                events.append(self._event("response.content_part.added", item_id=item_id,
                                          output_index=self._index(), content_index=0, part=_text_part("")))
        self.open["text"] += text
        self.open["logprobs"] += logprobs or []
        where = {"item_id": self.open["id"], "output_index": self._index(), "content_index": 0}
        if kind == "reasoning" and text:
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        elif kind == "message" and (text or logprobs):
            events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=list(logprobs or [])))
        return events

    def _call(self, call: dict) -> list[dict]:
        events = []
        fn = call.get("function") or {}
        if "id" in call:   # a new call: its header (and, from a parsed "auto" call, all of it)
            events += self._close(None)
            item_id = _id("fc")
            self.open = {"kind": "call", "id": item_id, "call_id": call["id"], "name": fn.get("name", ""),
                         "text": ""}
            events.append(self._event("response.output_item.added", output_index=self._index(),
                                      item=_call_item(item_id, call["id"], self.open["name"], "", "in_progress")))
        pieces = fn.get("arguments") or ""
        if pieces:
            self.open["text"] += pieces
            events.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=self._index(), delta=pieces))
        return events

    def _close(self, finish_reason: str | None) -> list[dict]:
        """The events that finish the open item, if any. The item open when the token
        limit ends the response (`finish_reason` "length") was cut, whatever its kind."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = self._index(), []
        where = {"item_id": item["id"], "output_index": index}
        status = "incomplete" if finish_reason == "length" else "completed"
        if item["kind"] == "reasoning":
            done = _reasoning_item(item["id"], item["text"], status)
            events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=item["text"]))
            events.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=done["content"][0]))
        elif item["kind"] == "message":
            done = _message_item(item["id"], item["text"], status, item["logprobs"])
            events.append(self._event("response.output_text.done", **where, content_index=0, text=item["text"],
                                      logprobs=list(item["logprobs"])))
            events.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=done["content"][0]))
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], item["text"], status)
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=item["text"]))
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        return events


def whole_response(envelope: ResponseBody, parts: list[tuple[str, object]], finish_reason: str | None,
                   usage_: dict, logprobs: TextLogprobs | None = None) -> dict:
    """The response body of a finished choice: what its stream ends with, made of all
    its pieces at once (`ChoiceParser.parts` of the whole text)."""
    stream = ResponseEvents(envelope, logprobs)
    stream.feed(parts)
    return stream.closing(finish_reason, usage_)[-1]["response"]
