"""OpenAI request bodies (pydantic, strict: unknown fields are rejected) and the
translation to the engine's `SamplingParams`."""

import json
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from runtime.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_SEQUENCES, SamplingParams
from runtime.structured_output import StructuredOutputsParams

from .tools import constraint as tool_constraint


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def refused(reason: str):
    """The type of an OpenAI field this server cannot honour: null passes, since some
    clients send every field they know, and any value is a 400 that says why."""
    def check(v):
        if v is not None:
            raise ValueError(reason)
        return v
    return Annotated[Any, AfterValidator(check)]


class StreamOptions(_Strict):
    """`include_usage`: a last chunk with the request's usage. With it,
    `continuous_usage_stats` (vLLM's extension) puts the usage so far in every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`; `strict` is accepted, and the output
    always follows the schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON that follows a
    schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema.schema_ is None:
            return StructuredOutputsParams(json_object=True, param="response_format")
        return StructuredOutputsParams(json=self.json_schema.schema_, param="response_format")

    def object_schema(self) -> dict | None:
        """The JSON schema of an answer in this format where the answer is an object, as
        OpenAI's formats are (the tool grammar offers such an answer beside calls); None
        for text or another root."""
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.type == "json_schema" else None
        if schema is None:
            return {"type": "object"}
        return schema if schema.get("type", "object" if "properties" in schema else None) == "object" else None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of a JSON schema, any JSON
    object, a regex, fixed choices or a Lark grammar."""

    json_: dict | str | None = Field(default=None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _check(self):
        self.constraint().check()   # the grammar itself: `OpenAIIngress._check_constraint`
        return self

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, json_object=self.json_object, regex=self.regex,
                                       choice=tuple(self.choice) if self.choice is not None else None,
                                       grammar=self.grammar)


class _Sampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    priority: int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    _constraint: StructuredOutputsParams | None = PrivateAttr(default=None)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for k, b in (v or {}).items():
            try:
                int(k)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structured_outputs is not None and self.response_format is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's structured output constraint, made once: its grammar (`spec`),
        made when the request is checked, goes with it to the engine."""
        if self._constraint is None and self.constraint_param() is not None:
            self._constraint = self._make_constraint()
        return self._constraint

    def constraint_param(self) -> str | None:
        """The field the constraint comes from, which errors name."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return None

    def _make_constraint(self) -> StructuredOutputsParams:
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return self.response_format.constraint()

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=logprobs, stop=list(self.stop or []), ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []), skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.constraint(),
        )


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _echo_only(self):
        if self.max_tokens == 0 and (not self.echo or self.stream):
            raise ValueError("max_tokens 0 scores the prompt alone: it needs echo, without stream")
        return self
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json(cls, v):
        try:
            json.loads(v)
        except ValueError:
            raise ValueError("a tool call's arguments must be JSON text") from None
        return v


class ToolCall(_Strict):
    """A call an assistant message made, as a client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    """A message as clients send it, including an assistant message that a client hands
    back as the `openai` client returned it: its `reasoning` (ours; vLLM's older name
    `reasoning_content`) goes back to the template, which some show on later turns, and
    OpenAI's empty `refusal`, `annotations`, `audio` and `function_call` are accepted."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: None = None

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content (a string or text parts); "
                             "only an assistant message may leave it null")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages, and only they, carry tool_call_id")
        if (self.reasoning or self.reasoning_content) and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as chat templates read it: tool call arguments as objects."""
        m = {"role": self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning or self.reasoning_content
        if reasoning:
            m["reasoning_content"] = reasoning   # the name Qwen3's and DeepSeek's templates read
            m["thinking"] = reasoning            # and gpt-oss's
        return m


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object(cls, v):
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("a function's parameters must be the JSON Schema of an object")
        return v


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(_Strict):
    """The functions a call may name: "auto", any or none of them; "required", one at
    least. The template still shows every tool (OpenAI's reason: the prompt, and its
    cache, stay the same as the allowed set changes)."""

    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(_Strict):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


_TEMPLATE_ARGS = {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "return_dict",
                  "documents", "continue_final_message", "chat_template"}


class _ChatTemplate(_Strict):
    """What shapes the chat template's prompt besides the messages (chat and /tokenize):
    `tools` to show, and `chat_template_kwargs` (vLLM's), variables of the template
    such as Qwen3's `enable_thinking`."""

    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs(cls, v):
        taken = sorted(_TEMPLATE_ARGS & set(v or {}))
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}")
        return v


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def metadata_checked(v: dict[str, str]) -> dict[str, str]:
    """OpenAI's bounds on `metadata`: up to 16 pairs, keys of up to 64 characters and
    values of up to 512."""
    if len(v) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} metadata pairs")
    for k, value in v.items():
        if len(k) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY} characters and values "
                             f"at most {MAX_METADATA_VALUE}")
    return v


Metadata = Annotated[dict[str, str], AfterValidator(metadata_checked)]


class Bookkeeping(_Strict):
    """OpenAI's bookkeeping fields of chat and Responses requests, which change nothing a
    model generates: accepted and left unused, so clients that always send them work.
    `store` keeps a chat completion (OpenAI's default: not) or a response (its default:
    kept) where the app has its store, with `metadata` (response_store.py)."""

    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None   # the prefix cache keeps what memory allows
    safety_identifier: str | None = None


NoAudio = refused("audio output is not supported: this server answers in text")
NoWebSearch = refused("web search is not supported: this server has no built-in tools")
NoFunctions = refused("functions is OpenAI's deprecated form of tools: send tools")
NoFunctionCall = refused("function_call is OpenAI's deprecated form of tool_choice: send tool_choice")


class Prediction(_Strict):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat, which there
    only makes the answer come sooner, never changes it; accepted and left unused."""

    type: Literal["content"]
    content: Union[str, list[TextPart]]


class ChatCompletionRequest(_Sampling, _ChatTemplate, Bookkeeping):
    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's: the template gets it as the variable `reasoning_effort` (gpt-oss's
    # template reads it; templates that do not are unchanged).
    reasoning_effort: Effort | None = None
    # OpenAI's length hint; no open chat template reads it (as Responses' `text.verbosity`).
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: Prediction | None = None
    modalities: list[Literal["text"]] | None = None   # text is the only one
    audio: NoAudio = None
    web_search_options: NoWebSearch = None
    functions: NoFunctions = None
    function_call: NoFunctionCall = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, AllowedToolsChoice, None] = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tools(self):
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct names")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        for allowed in self._allowed() or ():
            if allowed not in names:
                raise ValueError(f"tool_choice allows {allowed!r}, which is not among the tools")
        forced = self.forced_tool()
        if forced is not None:
            if self.structured_outputs is not None or (self.response_format and self.response_format.type != "text"):
                raise ValueError("a required or named tool_choice cannot be combined with response_format "
                                 "or structured_outputs")
        return self

    def tool_defs(self) -> list[dict]:
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def _allowed(self) -> list[str] | None:
        choice = self.tool_choice
        return [t.function.name for t in choice.allowed_tools.tools] if isinstance(choice, AllowedToolsChoice) else None

    def callable_defs(self) -> list[dict]:
        """The tools a call may name: all of them, or those `allowed_tools` lists."""
        allowed = self._allowed()
        return [d for d in self.tool_defs() if allowed is None or d["name"] in allowed]

    def restricts_calls(self) -> bool:
        """Whether `allowed_tools` leaves some tools out of the calls (its names are
        checked to be among the tools)."""
        allowed = self._allowed()
        return allowed is not None and len(set(allowed)) < len(self.tools)

    def template_kwargs(self) -> dict | None:
        """`chat_template_kwargs`, with `reasoning_effort` unless they set it."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def tool_mode(self) -> str | None:
        """None (no tools, or "none"), "auto", "required" or the named function."""
        if not self.tools or self.tool_choice == "none":
            return None
        return self.forced_tool() or "auto"

    def forced_tool(self) -> str | None:
        """"required" or the named function, when the choice forces a call."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        if isinstance(choice, AllowedToolsChoice):
            choice = choice.allowed_tools.mode
        return "required" if choice == "required" and self.tools else None

    def constraint_param(self) -> str | None:
        return "tools" if self.forced_tool() is not None else super().constraint_param()

    def _make_constraint(self) -> StructuredOutputsParams:
        forced = self.forced_tool()
        if forced is not None:
            return tool_constraint(self.callable_defs(), forced, self.parallel_tool_calls)
        return super()._make_constraint()

    def logprobs_k(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(_ChatTemplate):
    """vLLM's `/tokenize`: the token ids a `prompt` gets from /v1/completions, or that
    `messages` get from /v1/chat/completions (its chat template), so a client can count
    them against the context before it sends them."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    """vLLM's `/detokenize`: the text of token ids."""

    model: str
    tokens: list[int]


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    encode=None) -> list[int]:
    """The token ids the model's chat template makes of `messages` (and `tools`, in
    OpenAI's shape, for templates that show them; `template_kwargs`, such as Qwen3's
    `enable_thinking`, go to the template as variables). Raises whatever the template
    raises for messages it rejects. The rendered text is tokenized, without the special
    tokens a tokenizer adds around a text (the template writes its own), by `encode`
    (`encode(text, add_special_tokens)`, a `PromptTokenCache`'s, say) or the tokenizer."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **(template_kwargs or {}))
    return list((encode or tokenizer.encode)(text, add_special_tokens=False))
