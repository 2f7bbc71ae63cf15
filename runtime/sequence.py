"""One sequence the scheduler moves through WAITING -> RUNNING -> FINISHED.

A request with `n > 1` becomes n sequences that share the prompt's KV blocks through
the prefix cache.
"""

import enum
import itertools
from dataclasses import dataclass, field

from .outputs import Logprob
from .sampling_params import SamplingParams
from .structured_output import Grammar

_seq_counter = itertools.count()
PLACEHOLDER = -1   # a sampled token still on the device; the step after it is already queued


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    arrival: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)   # prompt + output
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    window_from: int = 0                                  # its blocks from here on hold window slots
    num_cached_tokens: int | None = None                  # prefix hit at first admission
    first_scheduled_time: float | None = None             # time.monotonic() at first admission
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    grammar: Grammar | None = None                        # structured outputs: what may come next
    early_stop_ids: tuple[int, ...] = ()                  # banned before `min_tokens`: EOS, stop ids
    prompt_logprobs: list[Logprob | None] | None = None   # asked for: one per prompt token so far

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all in: the prompt must be computed."""
        pl = self.prompt_logprobs
        return pl is not None and len(pl) < self.num_prompt_tokens

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)   # read several times a step

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens known on the host."""
        return self.token_ids[self.num_prompt_tokens:self.num_known_tokens]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, including any still in flight."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host: all but the trailing placeholders."""
        n = len(self.token_ids)
        while self.token_ids[n - 1] == PLACEHOLDER:
            n -= 1
        return n

    @property
    def out_of_budget(self) -> bool:
        """Its last token is sampled or in flight: `max_tokens` is reached."""
        return self.num_output_tokens >= self.params.max_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority, then arrival (FCFS)."""
        return (self.priority, self.arrival)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
