"""What the engine hands back each step; field names follow vLLM's deliberately."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The sampled token's logprob and the top alternatives, one entry per generated token."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request. `text`, `token_ids` and `logprobs` are
    cumulative; the `delta_*` fields hold what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[Logprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0

    def absorb(self, newer: "RequestOutput") -> "RequestOutput":
        """`newer`, with this output's deltas in front of its own: one output standing
        for both, for streams that send fewer, larger chunks."""
        older = {o.index: o for o in self.outputs}
        for o in newer.outputs:
            prev = older.get(o.index)
            if prev is not None:
                o.delta_text = prev.delta_text + o.delta_text
                o.delta_token_ids = list(prev.delta_token_ids) + list(o.delta_token_ids)
                o.delta_logprobs = list(prev.delta_logprobs) + list(o.delta_logprobs)
        return newer

    @property
    def usage(self) -> dict:
        completion = sum(len(o.token_ids) for o in self.outputs)
        return {
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": completion,
            "total_tokens": len(self.prompt_token_ids) + completion,
            "cached_tokens": self.num_cached_tokens,
        }
