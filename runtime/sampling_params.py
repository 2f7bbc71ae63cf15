"""Per-request sampling parameters, validated at the engine boundary."""

from dataclasses import dataclass, field

from .errors import InvalidSamplingParamsError
from .structured_output import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
MAX_N = 128


@dataclass
class SamplingParams:
    """What to sample and when to stop; names follow vLLM's `SamplingParams`.

    `min_tokens`: until this many tokens are out, neither EOS nor `stop_token_ids` can
    be sampled and stop strings are not looked for. `temperature == 0` is greedy.
    `top_k <= 0` and `top_p == 1` disable those filters.
    `logprobs=None` returns none; `logprobs=k` returns the sampled token's logprob plus the top k.
    `prompt_logprobs=k`: each prompt token's logprob (the first's is None) plus the top k
    at its position, on the request's first output and its whole ones; the prompt is
    then computed in full, without prefix cache hits.
    `output_kind="delta"`: outputs before the last carry only what is new (`delta_*`;
    their text, token ids, logprobs and prompt are empty) and the last carries it all,
    so an output costs the same however long the request has run (streaming servers);
    `"cumulative"` (the default) fills every output.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    output_kind: str = "cumulative"
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        def bad(msg, param):
            raise InvalidSamplingParamsError(msg, param)

        if self.output_kind not in ("cumulative", "delta"):
            bad(f"output_kind must be 'cumulative' or 'delta', got {self.output_kind!r}", "output_kind")
        if not 1 <= self.n <= MAX_N:
            bad(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        if self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
                "min_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
                "repetition_penalty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            bad(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}",
                "prompt_logprobs")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            bad(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(self.stop)}", "stop")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop sequences must be non-empty strings", "stop")
        for tok, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= tok < vocab_size:
                bad(f"logit_bias key {tok} is outside the vocabulary [0, {vocab_size})", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                bad(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")
        for tok in self.stop_token_ids:
            if vocab_size is not None and not 0 <= tok < vocab_size:
                bad(f"stop token id {tok} is outside the vocabulary", "stop_token_ids")
        if self.structured_outputs is not None:
            self.structured_outputs.check()   # the engine's compile checks the grammar
        return self
