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
class RequestMetrics:
    """When the engine took the request, first scheduled it and had its first token in
    hand, in `time.monotonic()` seconds of the engine's host (vLLM's `RequestMetrics`,
    trimmed). Differences between them hold on any host: `queue_time` and
    `prefill_time` split a TTFT into waiting and computing, wherever the caller runs.

    `AsyncEngine` adds its own moments, on the same host's clock (the engine loop runs
    on its thread or in its child process): when it sent the request to the loop, when
    the first output came back from the loop, and when `generate()` handed it to the
    caller. They time the way to the engine and back, which a server's event loop and
    GIL can stretch."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    submitted_time: float | None = None
    received_time: float | None = None
    delivered_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    def ttft_parts(self) -> dict[str, float]:
        """The engine's part of a TTFT by the names servers and benchmarks report it
        under: `engine_queue` and `engine_prefill`; empty before the first token. With
        `AsyncEngine`'s moments, also `to_engine` (sent to the loop, until the engine took
        it), `from_engine` (the first token, until the output was back beside the
        caller) and `to_caller` (from there until `generate()` yielded it): together with
        the engine's two, the whole time from sending the request to holding its first
        token."""
        if self.prefill_time is None:
            return {}
        parts = {"engine_queue": self.queue_time, "engine_prefill": self.prefill_time}
        if None not in (self.submitted_time, self.received_time, self.delivered_time):
            parts.update(to_engine=self.arrival_time - self.submitted_time,
                         from_engine=self.received_time - self.first_token_time,
                         to_caller=self.delivered_time - self.received_time)
        return parts


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None   # on the first output with tokens and on the last
    prompt_logprobs: list[Logprob | None] | None = None   # when asked for: first and whole outputs

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
        if newer.metrics is None:
            newer.metrics = self.metrics
        if newer.prompt_logprobs is None:
            newer.prompt_logprobs = self.prompt_logprobs
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
