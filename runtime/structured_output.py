"""Structured outputs: a request's text held to a JSON schema, any JSON object, a
regex, one of fixed choices or a Lark grammar.

llguidance compiles the constraint into a matcher over the tokenizer's vocabulary.
Before a constrained sequence samples, its matcher gives the bitmask of the tokens that
keep the text inside the constraint; the mask goes to the device, where every other
logit becomes -inf; after the step the matcher consumes the sampled token. The next
mask depends on that token, so while a constrained sequence runs the engine reads each
step back before it queues the next (as it does for penalties).

JSON is generated compact (", " and ": " between items, no other whitespace): a model
cannot spend its token budget on blank space, and the text parses as soon as the
grammar closes. For a thinking model the constraint holds the answer, after the
reasoning, as vLLM's reasoning parsers do (`reasoning_state`); a Lark grammar, which can
name the think markers, holds the whole text.
"""

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from .errors import InvalidRequestError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint; names follow vLLM's `StructuredOutputsParams`.

    `json`: a JSON schema (a dict, or its JSON text); `json_object`: any JSON object;
    `regex`: the whole text matches it; `choice`: the text is one of these strings;
    `grammar`: a Lark grammar (llguidance's dialect). `param`: the request field the
    constraint came from, which its errors name.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str = field(default="structured_outputs", compare=False)

    def kinds(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    def check(self) -> str:
        """The kind of the one constraint given; `InvalidRequestError` unless there is
        exactly one, of the right shape (the grammar itself is checked by `validate`,
        and when it is compiled)."""
        kinds = self.kinds()
        if len(kinds) != 1:
            raise InvalidRequestError(f"give exactly one structured output constraint of {', '.join(KINDS)}; "
                                      f"got {', '.join(kinds) or 'none'}", self.param)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings", self.param)
        return kinds[0]

    @cached_property
    def spec(self) -> str:
        """The constraint as an llguidance grammar, not yet compiled, made once (it goes
        with the params to the engine); `InvalidRequestError` for a bad shape or a JSON
        schema that is not a JSON object."""
        kind = self.check()
        try:
            if self.json is not None:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"the {kind} constraint is not valid: {e}", self.param) from None
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # Lark string literals take JSON's escapes.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)

    def validate(self) -> "StructuredOutputsParams":
        """Raises `InvalidRequestError` unless the constraint is one well-formed grammar,
        checked without a tokenizer: for a server's front, which has no engine vocabulary
        at hand (`GrammarCompiler.compile` checks the same). A grammar checked before is
        not checked again (`grammar_error`)."""
        self.error_if(grammar_error(self.spec))
        return self

    def error_if(self, error: str) -> None:
        if not error:
            return
        if self.param == "tools":   # made from the tools' schemas: say only what is wrong with them
            fault = error.splitlines()[0].split("failed to compile JSON schema: ")[-1]
            raise InvalidRequestError(f"the tools' parameters cannot be enforced: {fault}", "tools")
        raise InvalidRequestError(f"the {self.check()} constraint is not valid: {error}", self.param)


GRAMMAR_CACHE_SIZE = 128   # distinct grammars kept checked, and compiled, per process


class RecentCache:
    """A bounded, thread-safe map that forgets its least recently used entry first."""

    def __init__(self, size: int = GRAMMAR_CACHE_SIZE):
        self.size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


_checked = RecentCache()


def grammar_error(spec: str) -> str:
    """llguidance's complaint about a grammar, "" when it is well-formed. Checking a large
    schema takes tens of milliseconds (one of 200 properties: about 20 ms), and clients
    send the same schemas and tool sets again and again, so answers are kept.
    llguidance releases the GIL while it checks: a caller may run this on a thread."""
    error = _checked.get(spec)
    if error is None:
        error = LLMatcher.validate_grammar(spec)
        _checked.put(spec, error)
    return error


def grammar_checked(spec: str) -> bool:
    """Whether `grammar_error(spec)` would answer at once."""
    return _checked.get(spec) is not None


THINK_TAIL = 16   # prompt tokens where a template opens or closes the reasoning


def reasoning_state(tokenizer, prompt_ids: list[int]) -> str:
    """Where a thinking model's reasoning stands when the prompt ends, read from the think
    markers mlx-lm's tokenizer knows in the prompt's last `THINK_TAIL` tokens: "answer"
    when they close it (Qwen3 with `enable_thinking: false`), and for a model without
    markers; "thinking" when they open it (DeepSeek-R1's template); else "may_think": the
    first token may open it. A server splits reasoning from content by it, and a
    constraint starts from it, so a model of a thinking vocabulary that answers at once
    is constrained from its first token."""
    if not getattr(tokenizer, "has_thinking", False):
        return "answer"
    lo = max(0, len(prompt_ids) - THINK_TAIL)
    start = tokenizer.rfind_think_start(prompt_ids, start=lo)
    end = tokenizer.rfind_think_end(prompt_ids, start=lo)
    return "answer" if end > start else "thinking" if start > end else "may_think"


def think_markers(tokenizer) -> tuple[int, int] | None:
    """A thinking model's start and end marker ids, where each is one token (what a
    grammar can let through or wait for); else None."""
    start, end = getattr(tokenizer, "think_start_tokens", None), getattr(tokenizer, "think_end_tokens", None)
    if not getattr(tokenizer, "has_thinking", False) or len(start or ()) != 1 or len(end or ()) != 1:
        return None
    return start[0], end[0]


class Grammar:
    """One sequence's matcher: the tokens it allows next, and the tokens it consumes.

    For a thinking model (`think`: its start and end marker ids) the matcher holds the
    answer only: `state` "thinking" leaves the tokens free until the end marker;
    "may_think" allows the start marker besides what the matcher allows, first."""

    __slots__ = ("matcher", "words", "think", "state")

    def __init__(self, matcher: LLMatcher, words: int, think: tuple[int, int] | None = None,
                 state: str = "answer"):
        self.matcher, self.words = matcher, words   # words: the bitmask's 32-bit words
        self.think, self.state = think, state

    @property
    def masks(self) -> bool:
        return self.state != "thinking"

    def consume(self, token: int) -> bool:
        """Advance past a sampled token. False once nothing more may follow: the
        grammar is complete (or, never for a masked token, broken)."""
        if self.state == "thinking":
            if token == self.think[1]:
                self.state = "answer"
            return True
        if self.state == "may_think":
            self.state = "thinking" if token == self.think[0] else "answer"
            if self.state == "thinking":
                return True
        m = self.matcher
        return m.consume_token(token) and not m.is_stopped()

    def copy(self) -> "Grammar":
        """A grammar in the same state, for another sequence of the request."""
        return Grammar(self.matcher.deep_copy(), self.words, self.think, self.state)

    def fill(self, row: np.ndarray) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.state == "may_think":
            row[self.think[0] // 32] |= np.uint32(1 << (self.think[0] % 32))


class GrammarCompiler:
    """Makes a request's grammars over one tokenizer's vocabulary. Building that
    vocabulary's index takes about 0.4 s for a 128k-token tokenizer (once, holding the
    GIL); compiling a grammar from under a millisecond to tens of them (llguidance
    releases the GIL meanwhile, so it may run on a thread). Compiled grammars are kept:
    a grammar compiled before costs a copy of its matcher, about a microsecond."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids):
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InvalidRequestError("structured outputs need a fast (Rust `tokenizers`) tokenizer, "
                                      "and this model's is not", "structured_outputs")
        self.tokenizer = LLTokenizer(backend.to_str(), n_vocab=max(vocab_size, backend.get_vocab_size()),
                                     eos_token=sorted(eos_token_ids))
        self.words = -(-self.tokenizer.vocab_size // 32)
        self._compiled = RecentCache()   # spec -> a matcher never advanced, to copy

    def compiled(self, params: StructuredOutputsParams) -> bool:
        """Whether `compile(params)` only copies a matcher compiled before."""
        return self._compiled.get(params.spec) is not None

    def compile(self, params: StructuredOutputsParams, think: tuple[int, int] | None = None,
                state: str = "answer") -> Grammar:
        """`think`, `state`: a thinking model's markers (`think_markers`) and where to
        begin (`reasoning_state`)."""
        m = self._compiled.get(params.spec)
        if m is None:
            m = LLMatcher(self.tokenizer, params.spec, log_level=0)
            if m.is_error():
                params.error_if(m.get_error() or "it could not be compiled")
            self._compiled.put(params.spec, m)
        return Grammar(m.deep_copy(), self.words, think, state)


def allowed_tokens(grammars: list[Grammar], vocab_size: int) -> mx.array:
    """(len(grammars), vocab_size) bool: the tokens each grammar lets come next. The
    bitmask crosses to the device packed, one bit per token, and is unpacked there: as
    little-endian bytes, byte b's bit i is token 8b + i, so each byte is shifted by
    0..7 and the result laid flat (no gather: on the CPU backend 3.3x faster than
    indexing a word per token, 256 rows of a 128k vocabulary)."""
    mask = np.zeros((len(grammars), grammars[0].words), dtype="<u4")
    for g, row in zip(grammars, mask):
        g.fill(row)
    octets = mx.array(mask.view(np.uint8))
    bits = (octets[:, :, None] >> mx.arange(8, dtype=mx.uint8)) & 1
    return bits.reshape(len(grammars), -1)[:, :vocab_size].astype(mx.bool_)
