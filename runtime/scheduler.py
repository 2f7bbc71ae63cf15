"""Continuous batching: which sequences run in the next step, and with how many tokens.

Prefill and decode share one forward pass. Every step has a token budget
(`max_num_batched_tokens`) and a cap on running sequences (`max_num_seqs`). Running
sequences go first, in priority order, each taking one decode token or the next
chunk of its prompt; what budget is left admits waiting sequences, whose prompts are
cut into chunks when they do not fit. So a long prompt enters a few hundred tokens a
step while the decodes around it keep producing a token every step.

When the pool runs out of blocks, the lowest-priority (latest) running sequence is
preempted by recompute: its blocks are freed, it goes back to the waiting queue with
the tokens it has generated, and on readmission it finds most of its prefix in the
prefix cache. A request never fails for lack of KV memory unless it alone cannot fit.

With `enable_continuous_batching=False` the scheduler batches statically: it admits a
batch only when nothing is running and runs it to completion (for benchmarks).
"""

import heapq
import itertools
import time
from dataclasses import dataclass, field

from .attention import sort_key
from .config import EngineConfig
from .kv.block_manager import KVCacheManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int          # new tokens computed this step
    start: int               # position of the first of them
    samples: bool = field(init=False)   # the step reaches the end of the tokens: it yields one

    def __post_init__(self):
        self.samples = self.start + self.num_tokens == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: list[tuple[tuple[int, int], int, Sequence]] = []   # heap
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.arrival = next(self._arrivals)
        self._push_waiting(seq)

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting, (seq.sort_key, seq.seq_id, seq))

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (stopped, aborted): free its blocks, drop it from queues."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting = [w for w in self.waiting if w[2] is not seq]
            heapq.heapify(self.waiting)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        self.running.sort(key=lambda s: s.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.out_of_budget or seq.num_tokens >= self.max_model_len:
                i += 1   # its last token is in flight; the engine finishes it on read-back
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                victim = self._pick_victim(scheduled_ids)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
                scheduled_ids.add(seq.seq_id)
                budget -= n
                i += 1

        static = not self.config.enable_continuous_batching
        if static:
            # A static batch is admitted whole, prompts unchunked, once nothing runs.
            budget = float("inf") if not self.running else 0
        while not out.preempted and self.waiting and budget > 0 \
                and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0][2]
            computed = self.kv.get_computed_blocks(seq)
            start = len(computed) * self.kv.block_size
            remaining = seq.num_tokens - start
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            n = min(remaining, budget)
            if not self.kv.allocate_slots(seq, n, computed):
                if not self.running and not out.scheduled:
                    # Alone and still too big: only possible if the pool is smaller
                    # than one sequence; the engine rejects such prompts up front.
                    raise RuntimeError("KV pool cannot hold a single sequence")
                break
            heapq.heappop(self.waiting)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = start
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, start))
            budget -= n

        out.scheduled.sort(key=lambda s: sort_key(s.num_tokens, s.start + s.num_tokens))
        return out

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence:
        """The lowest-priority running sequence not yet scheduled this step."""
        for seq in reversed(self.running):
            if seq.seq_id not in scheduled_ids:
                return seq
        raise AssertionError("every running sequence is already scheduled")

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self._push_waiting(seq)
