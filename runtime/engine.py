"""The engine: requests in, one scheduled forward pass per `step()`, outputs out.

`LLMEngine` is synchronous: one caller drives it (its only helper thread processes a
step's tokens while the caller waits in MLX, and with an `output_sink` hands the outputs
on from there). `AsyncEngine` (async_engine.py) runs it on a background thread or in a
process of its own for servers.
"""

import bisect
import gc
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

import mlx.core as mx

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .errors import (DuplicateRequestError, EmptyPromptError, InvalidRequestError,
                     PromptTooLongError, TokenOutOfVocabularyError)
from .kv.block_manager import KVCacheManager
from .kv.block_pool import device_memory_bytes, kv_bytes_per_block, num_blocks_for_budget
from .kv.window_slots import WindowSlots, num_window_slots
from .model_runner import ModelRunner, PendingStep
from .models.fuse import fuse_projections
from .models.loader import activation_dtype, kv_geometry, layer_windows, load, max_context
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import PLACEHOLDER, Sequence, SequenceStatus
from .structured_output import Grammar, GrammarCompiler, reasoning_state, think_markers

log = logging.getLogger(__name__)

# Steps sampling fewer sequences process their tokens inline, where the hand-off to the
# worker thread and back would cost about what it saves. Measured on an H200 (1B model,
# decode steps): 1.08x faster steps at 32 sequences, 1.35x at 128, 1.25x at 256. On MLX's
# CPU backend, queuing a step computes it, so with an `output_sink` every step hands off:
# inline, a step's outputs would wait for the next step's compute, a whole prefill of new
# arrivals at times (served, 16 streams on the 2-core CI host: TTFT p50 209 against 588
# ms, 722 against 622 tok/s). On a GPU a small step that samples some request's first
# token hands off too: inline, that token would wait for the next step's queuing, 4-9
# ms on an H100 (`hit_profile_gpu_h100_cprofile.json`), added to its time to first token.
OVERLAP_MIN_SEQS = 32
# A small step that samples some request's first token is read back before the next
# step is built, not after, when the device is keeping up with the host: its token then
# leaves a build earlier (the next step's graph, 1.5-3 ms on an H100), and the device,
# done already, loses nothing. A larger step (a long prefill) keeps the overlap: its
# device time hides the next build, and its first token leaves when the device is done
# either way. The device counts as keeping up while reading a step back blocks less
# than `EARLY_READ_MAX_BLOCK_S`; a read that blocks longer turns this off until one
# does not. On MLX's CPU backend a step is done once queued: every size reads early.
EARLY_READ_MAX_TOKENS = 512
EARLY_READ_MAX_BLOCK_S = 0.001
# Upper bounds (seconds) of the step-duration histogram in `stats()`. A step normally
# takes milliseconds; one that stalls the loop (a kernel compiled or an attention plan
# built on first use, a swap) holds up every request waiting for its turn.
STEP_TIME_BOUNDS_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
# MLX keeps freed device buffers for reuse up to its cache limit, which on Metal and
# CUDA is its whole memory limit. Steps of ever-changing shapes leave buffers of every
# size behind: at 256 sequences on an H100 the cache grew to 57 GiB beside a 16 GiB KV
# pool, MLX's whole limit held (bench/results/buffer_cache_gpu_h100.json), memory that a
# second engine on the card, or a Mac's other processes, then lack.
# By default an engine bounds it by a share of its KV pool, never raising MLX's own.
BUFFER_CACHE_POOL_SHARE = 0.25
MIN_BUFFER_CACHE_BYTES = 1 << 30


def bound_buffer_cache(limit: int | None, pool_bytes: int) -> int:
    """Set MLX's cache limit (process-wide) to `limit`, or with None to the larger of
    `MIN_BUFFER_CACHE_BYTES` and `BUFFER_CACHE_POOL_SHARE` of the KV pool, if that is
    below MLX's own; returns the limit in force."""
    if limit is None:
        limit = max(MIN_BUFFER_CACHE_BYTES, int(pool_bytes * BUFFER_CACHE_POOL_SHARE))
        previous = mx.set_cache_limit(limit)
        if previous < limit:
            mx.set_cache_limit(previous)
            return previous
        return limit
    mx.set_cache_limit(limit)
    return limit


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    sent: list[int] = field(default_factory=list)   # output tokens already returned, per seq

    def __post_init__(self):
        self.sent = [0] * len(self.seqs)

    # Both are read for every output, every step; most requests have one sequence.
    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs[0].status is SequenceStatus.FINISHED
        return all(s.is_finished for s in seqs)

    @property
    def num_cached_tokens(self) -> int:
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs[0].num_cached_tokens or 0
        return min(s.num_cached_tokens or 0 for s in seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.device is not None:
            device = mx.cpu if config.device == "cpu" else mx.gpu
            if not mx.is_available(device):
                raise ValueError(f"device {config.device!r} is not available to MLX here "
                                 f"(default: {mx.default_device()})")
            mx.set_default_device(device)
        self.model, self.tokenizer, self.model_config = load(config.model, config.trust_remote_code,
                                                             config.adapter_path)
        if config.fuse_projections:
            log.info("fused %d projection sets", fuse_projections(self.model))
        self._hf = self.tokenizer._tokenizer
        self.vocab_size = self.model_config.get("vocab_size") or len(self._hf)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids or [])
        self.max_model_len = config.max_model_len or max_context(self.model_config)

        _, kv_heads, head_dim = kv_geometry(self.model)
        dtype = getattr(mx, config.kv_cache_dtype) if config.kv_cache_dtype else activation_dtype(self.model)
        windows = layer_windows(self.model)
        self.num_blocks, window = self._kv_layout(windows, kv_heads, head_dim, dtype)
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching, window)
        self.runner = ModelRunner(self.model, windows, self.num_blocks, config.block_size, dtype,
                                  config.attention_backend, config.compile_decode,
                                  config.graph_prefill_tokens, config.prefill_kernel, window)
        self.runner.verify()
        self.kv_bytes = sum(p.nbytes for p in self.runner.pools())
        self.buffer_cache_limit = bound_buffer_cache(config.buffer_cache_bytes, self.kv_bytes)
        if self.runner.decode_graph is not None:
            t = time.perf_counter()
            # Room for a short prefill chunk beside a full batch of decodes.
            n = self.runner.decode_graph.warm_up(config.max_num_seqs + config.graph_prefill_tokens,
                                                 -(-self.max_model_len // config.block_size))
            log.info("compiled decode: %d shape buckets traced in %.1f s", n, time.perf_counter() - t)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        self._grammars: GrammarCompiler | None = None   # made by `warm_grammars` or the first structured request
        self._grammars_lock = threading.Lock()
        self.requests: dict[str, _Request] = {}
        self._inflight: PendingStep | None = None
        self._worker: ThreadPoolExecutor | None = None   # processes tokens while a step is queued
        self._undelivered: list[RequestOutput] = []
        self._device_keeps_up = True   # the last step read back was done (`EARLY_READ_MAX_TOKENS`)
        # Where the outputs of a step processed on the worker thread go as soon as they
        # are ready; None (and for steps processed inline): `step()` returns them.
        self.output_sink: Callable[[list[RequestOutput]], None] | None = None
        # Whether a running request's output is wanted after this step (None: always).
        # A paced stream's output (`OutputPacer`) is not made until it is due: the one
        # made then carries every token since the last, as `_completion` counts them, so
        # the hundreds made a second at 256 streams only to be held are never made.
        self.output_wanted: Callable[[str], bool] | None = None
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0,
                          "step_failures": 0}
        self._step_counts = [0] * (len(STEP_TIME_BOUNDS_S) + 1)   # the last: slower than all bounds
        self._step_seconds = 0.0
        # MLX's CPU backend computes a step when it is queued (`mx.async_eval` returns
        # after it), where a GPU's returns once the kernels are encoded.
        self._queue_computes = mx.default_device() == mx.cpu
        mx.random.seed(config.seed)
        # The model, tokenizer and pool bookkeeping live as long as the process; left in
        # the collector's generations, every full collection walks them again (about
        # 3 ms a step at 256 running sequences). Freezing them keeps collections small.
        gc.freeze()
        log.info("engine ready: %s, %d KV blocks of %d tokens%s (%.1f MiB), backend %s",
                 config.model, self.num_blocks, config.block_size,
                 f" and {window.num_slots} window slots" if window else "", self.kv_bytes / 2**20,
                 self.runner.attention_backend)

    def _budget(self) -> int:
        c = self.config
        return c.kv_cache_memory_bytes or int(device_memory_bytes() * c.kv_cache_memory_fraction)

    def _kv_layout(self, per_layer: list[int | None], kv_heads: int, head_dim: int,
                   dtype: mx.Dtype) -> tuple[int, WindowSlots | None]:
        """The main pool's blocks and, for a model with both sliding-window and
        full-attention layers (`window_pool`), its sliding layers' window slots; one
        pool of every layer where the budget cannot hold a window pool beside it."""
        c = self.config
        geometry = (kv_heads, head_dim, dtype.size, c.block_size)
        num_layers = len(per_layer)
        windows = [w for w in per_layer if w is not None]
        if c.window_pool and 0 < len(windows) < num_layers:
            per_block = kv_bytes_per_block(num_layers - len(windows), *geometry)
            per_slot = kv_bytes_per_block(len(windows), *geometry)
            slots = self._num_window_slots(max(windows), per_slot, len(windows) / num_layers)
            reserved = (slots + 1) * per_slot
            if c.num_gpu_blocks is not None or self._budget() - reserved >= per_block:
                n = self._num_blocks(per_block, reserved)
                return n, WindowSlots(slots, n, max(windows), c.block_size)
            log.warning("a KV budget of %d bytes cannot hold the window pool (%d bytes) beside the main pool: "
                        "one pool holds every layer", self._budget(), reserved)
        return self._num_blocks(kv_bytes_per_block(num_layers, *geometry)), None

    def _num_window_slots(self, window: int, per_slot: int, share: float) -> int:
        """The window pool's slots: `num_window_slots` for the engine's batch, and within
        the share of the KV budget its layers would hold in the one pool, so the main
        pool never holds fewer blocks than it would then."""
        c = self.config
        step = c.max_num_batched_tokens if c.enable_continuous_batching else \
            max(c.max_num_batched_tokens, self.max_model_len)
        n = num_window_slots(window, c.block_size, c.max_num_seqs, step)
        if c.num_gpu_blocks is not None:
            return n
        single = -(-(step + window) // c.block_size) + 2   # one sequence's most
        return max(min(n, int(self._budget() * share) // per_slot - 1), single)

    def _num_blocks(self, per_block: int, reserved: int = 0) -> int:
        """The main pool's blocks: the KV budget less `reserved` (the window pool's)."""
        c = self.config
        if c.num_gpu_blocks is not None:
            return c.num_gpu_blocks
        n = num_blocks_for_budget(self._budget() - reserved, per_block)
        # More than every sequence at full length (twice, for the prefix cache) is waste.
        useful = 2 * c.max_num_seqs * -(-self.max_model_len // c.block_size)
        return min(n, useful)

    # -- requests ----------------------------------------------------------------
    def validate_request(self, prompt, prompt_token_ids, params: SamplingParams) -> list[int]:
        """The prompt's token ids; a typed `InvalidRequestError` for bad input (a
        structured output's grammar is checked when it is compiled)."""
        params.validate(self.vocab_size)
        if prompt_token_ids is None:
            if prompt is None:
                raise EmptyPromptError()
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
            prompt_token_ids = self.tokenizer.encode(prompt) if prompt else []
        prompt_token_ids = list(prompt_token_ids)
        if not prompt_token_ids:
            raise EmptyPromptError()
        for t in prompt_token_ids:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise TokenOutOfVocabularyError(t, self.vocab_size)
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        capacity = self.num_blocks * self.config.block_size
        if len(prompt_token_ids) + params.max_tokens > capacity:
            raise InvalidRequestError(
                f"the request needs {len(prompt_token_ids) + params.max_tokens} tokens of KV "
                f"cache, more than the {capacity} this replica holds", "max_tokens")
        return prompt_token_ids

    def add_request(self, request_id: str, prompt: str | None = None,
                    params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    grammar: Grammar | None = None, arrival_time: float | None = None) -> None:
        """Queue a request. Raises a typed `InvalidRequestError` for bad input.

        `grammar`: the request's structured output grammar, compiled beforehand
        (`compile_grammar`, which a server may run on another thread); else it is
        compiled here. `arrival_time`: when the request reached the engine, if before
        now (`time.monotonic()`)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise DuplicateRequestError(request_id)
        ids = self.validate_request(prompt, prompt_token_ids, params)
        stops = params.stop
        seqs = [Sequence(request_id, i, ids, params, priority, cache_salt) for i in range(params.n)]
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = [None]   # the first token has none; the others share the prompt
        if params.min_tokens:
            early = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            for s in seqs:
                s.early_stop_ids = tuple(sorted(early))
        if params.structured_outputs is not None:
            grammar = grammar or self.compile_grammar(params, ids)
            for s in seqs:
                s.grammar = grammar if s.index == 0 else grammar.copy()
        detoks = [IncrementalDetokenizer(self._hf, ids, stops, params.skip_special_tokens) for _ in seqs]
        self.requests[request_id] = _Request(request_id, prompt, ids, params, seqs, detoks,
                                             RequestMetrics(arrival_time or time.monotonic()))
        for s in seqs:
            self.scheduler.add(s)
        self._counters["prompt_tokens"] += len(ids)

    def _compiler(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self._hf, self.vocab_size, self.eos_token_ids)
            return self._grammars

    def warm_grammars(self) -> None:
        """Build the vocabulary's grammar index now rather than for the first structured
        request: llguidance takes about 0.4 s and 88 MiB for a 128k-token vocabulary,
        holding the GIL, which would stall every stream running then. Safe on another
        thread; `InvalidRequestError` for a tokenizer that cannot have one."""
        self._compiler()

    def grammar_compiled(self, params: SamplingParams) -> bool:
        """Whether `compile_grammar` for these params only copies a grammar compiled
        before (about a microsecond), so a server need not move it off its loop."""
        return self._grammars is not None and self._grammars.compiled(params.structured_outputs)

    def compile_grammar(self, params: SamplingParams, prompt_token_ids: list[int]) -> Grammar:
        """The structured output grammar of a request with this prompt. Safe to call on
        another thread while the engine steps. `InvalidRequestError` for a bad one."""
        so = params.structured_outputs
        # A Lark grammar can name the think markers itself: it holds the whole text.
        think = think_markers(self.tokenizer) if so.grammar is None else None
        state = reasoning_state(self.tokenizer, prompt_token_ids) if think else "answer"
        return self._compiler().compile(so, think, state)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. False if it was unknown or done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for s in req.seqs:
            self.scheduler.finish(s, "abort")
        return True

    def recover(self) -> list[str]:
        """After a step raised (out of device memory, say): abort every request that
        holds KV state, drop the prefix cache and write a fresh pool, since the failed
        step may have left the pool unevaluable. Waiting requests stay queued. Returns
        the ids of the aborted requests."""
        self._inflight = None
        failed = [rid for rid, req in self.requests.items()
                  if any(s.status is SequenceStatus.RUNNING for s in req.seqs)]
        for rid in failed:
            self.abort(rid)
        self.kv.cache.reset()
        for pool in self.runner.pools():
            pool.reset()
        if self.kv.window is not None:
            self.kv.window.reset()
        mx.clear_cache()
        self._counters["step_failures"] += 1
        return failed

    def close(self) -> None:
        """Stop the token-processing worker thread, if one was started. The engine can
        still step afterwards: the next large step starts a new one."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._inflight is not None or bool(self._undelivered)

    # -- stepping -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Queue the next forward pass on the device, then read back and process the
        one queued before it, so host work (detokenizing, stop checks, scheduling)
        overlaps device work. A sequence whose sampling needs its history on the host
        (penalties) makes the engine finish the step in flight first; one under a
        structured output constraint defers only its step's sampling (`_build`)."""
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            took = time.perf_counter() - t0
            self._step_seconds += took
            self._step_counts[bisect.bisect_left(STEP_TIME_BOUNDS_S, took)] += 1

    def _step(self) -> list[RequestOutput]:
        outputs, self._undelivered = self._undelivered, []
        prev = self._inflight
        if prev is not None and any(s.params.has_penalties for s in self.scheduler.running):
            outputs += self._finish_step(prev)
            self._inflight = None
        elif prev is not None and self._reads_early(prev):
            early = self._finish_step(prev)
            self._inflight = None
            self.runner.wait()   # the next step is queued on an idle device (`ModelRunner.queue`)
            if self.output_sink is not None and early:
                self.output_sink(early)
            else:
                outputs += early
        sched = self.scheduler.schedule()
        prev, launched = self._inflight, self._build(sched) if sched else None
        if prev is not None:
            outputs += self._finish_step(prev, launched)
        elif launched is not None:
            self.runner.queue(launched)
        if launched is not None and launched.deferred:
            # Its forward pass runs while `prev`'s tokens were processed (the grammars
            # consumed them); now its masks can be made, and it samples behind it.
            self.runner.sample(launched)
        self._inflight = launched
        if not self.config.async_scheduling and launched is not None:
            outputs += self._finish_step(launched)
            self._inflight = None
        return outputs

    def _build(self, sched) -> PendingStep:
        # Penalties read the host's token history: their steps wait for the one before.
        # A grammar's mask needs only the previous token consumed, which the host does
        # while this step's forward pass runs: only the sampling waits.
        defer = any(s.seq.grammar is not None for s in sched.scheduled if s.samples)
        pending = self.runner.build(sched.scheduled, self._inflight, defer_sampling=defer)
        for s in sched.scheduled:
            seq = s.seq
            if s.samples:
                pending.positions.append(len(seq.token_ids))
                seq.token_ids.append(PLACEHOLDER)
            seq.num_computed_tokens = s.start + s.num_tokens
        return pending

    def _reads_early(self, pending: PendingStep) -> bool:
        """Whether the step in flight is read back before the next one is built
        (`EARLY_READ_MAX_TOKENS`)."""
        return (self._device_keeps_up and len(pending.seqs) < OVERLAP_MIN_SEQS
                and (self._queue_computes or pending.num_tokens <= EARLY_READ_MAX_TOKENS)
                and self._samples_first_token(pending))

    def _finish_step(self, pending: PendingStep, then: PendingStep | None = None) -> list[RequestOutput]:
        """Read back `pending`'s sampled tokens and process them; queue `then`, the next
        step, on the device meanwhile. Queuing encodes the step's kernels with the GIL
        released, so for large steps the tokens are processed on a worker thread during
        it: the two host costs overlap instead of adding up. Only this thread calls MLX."""
        t = time.perf_counter()
        tokens = self.runner.collect(pending)
        self._device_keeps_up = time.perf_counter() - t < EARLY_READ_MAX_BLOCK_S
        if then is None:
            return self._process(pending, tokens)
        # `then` may be queued only once `pending` is done (see `ModelRunner.queue`). Wait
        # before any hand-off: returning from an MLX call takes the GIL back, and the
        # worker holds it while it runs.
        self.runner.wait()
        hand_off = len(tokens) >= OVERLAP_MIN_SEQS or (
            self.output_sink is not None and (self._queue_computes or self._samples_first_token(pending)))
        if not hand_off:
            self.runner.queue(then)
            return self._process(pending, tokens)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="engine-tokens")
        done = self._worker.submit(self._process if self.output_sink is None else self._process_and_send,
                                   pending, tokens)
        try:
            self.runner.queue(then)
        except BaseException:
            # The tokens were processed (requests may have finished and left
            # `self.requests`): hand their outputs out with the next step.
            self._undelivered = done.result()
            raise
        return done.result()

    @staticmethod
    def _samples_first_token(pending: PendingStep) -> bool:
        return any(pos == seq.num_prompt_tokens for seq, pos in zip(pending.seqs, pending.positions))

    def _process_and_send(self, pending: PendingStep, tokens: list) -> list[RequestOutput]:
        """`_process`, then the outputs straight to `output_sink`, from the worker thread
        while the next step is being queued: they need not wait for it. On MLX's CPU
        backend queuing computes the step before it returns (23 of a 31 ms step at 64
        sequences), and outputs that waited for it reached the server a step late."""
        outputs = self._process(pending, tokens)
        if outputs:
            self.output_sink(outputs)
        return []

    def _process(self, pending: PendingStep, tokens: list) -> list[RequestOutput]:
        """Runs for every sequence every step, so it keeps to plain attribute reads.
        Touches no MLX array: it may run on the worker thread while MLX encodes."""
        if pending.prompt is not None:
            for (seq, first, *_), entries in zip(pending.prompt.spans, pending.prompt.entries):
                have, new = seq.prompt_logprobs, len(seq.prompt_logprobs) - 1 - first
                if new >= 0:   # a recomputed prompt adds nothing twice
                    have.extend(entries[new:])
        touched: dict[str, _Request] = {}
        requests, finished, appended = self.requests, SequenceStatus.FINISHED, 0
        for seq, pos, tok in zip(pending.seqs, pending.positions, tokens):
            if seq.status is finished:
                continue   # stopped or aborted while this step was in flight
            req = requests[seq.request_id]
            touched[seq.request_id] = req
            seq.token_ids[pos] = tok.token_id
            self._append(req, seq, pos, tok.token_id, tok.logprob)
            appended += 1
        self._counters["generation_tokens"] += appended
        wanted = self.output_wanted
        return [self._output(r) for r in touched.values()
                if wanted is None or r.metrics.first_token_time is None or r.finished or wanted(r.request_id)]

    def _append(self, req: _Request, seq: Sequence, pos: int, token: int, logprob) -> None:
        if logprob is not None:
            seq.logprobs.append(logprob)
        detok = req.detoks[seq.index]
        p = seq.params
        past_min = pos - seq.num_prompt_tokens >= p.min_tokens   # stop strings count from here
        reason = None
        if token in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason = "stop"
        else:
            detok.add(token, past_min)
            if detok.stopped:
                reason = "stop"
            elif seq.grammar is not None and not seq.grammar.consume(token):
                reason = "stop"   # the grammar is complete
            elif pos + 1 - seq.num_prompt_tokens >= p.max_tokens or pos + 1 >= self.max_model_len:
                reason = "length"
        if reason:
            detok.finish(past_min)
            del seq.token_ids[pos + 1:]   # a token queued after this one is void
            self.scheduler.finish(seq, reason)

    def _output(self, req: _Request) -> RequestOutput:
        finished, cached = req.finished, req.num_cached_tokens
        whole = finished or req.params.output_kind == "cumulative"
        outs = [self._completion(req, seq, whole) for seq in req.seqs]
        if finished:
            self.requests.pop(req.request_id, None)
            self._counters["requests_finished"] += 1
        m = req.metrics
        if m.first_token_time is None:   # a request's first output carries its first token
            m.first_token_time = time.monotonic()
            m.first_scheduled_time = min((s.first_scheduled_time for s in req.seqs
                                          if s.first_scheduled_time is not None), default=None)
        elif not finished:
            m = None
        first = req.seqs[0].prompt_logprobs
        prompt_lps = list(first) if first is not None and (whole or m is not None) else None
        if not whole:
            return RequestOutput(req.request_id, None, [], outs, False, cached, m, prompt_lps)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, cached, m,
                             prompt_lps)

    def _completion(self, req: _Request, seq: Sequence, whole: bool) -> CompletionOutput:
        """`whole`: with the cumulative text, token ids and logprobs, not only deltas."""
        start, known = seq.num_prompt_tokens, seq.num_known_tokens
        sent, req.sent[seq.index] = req.sent[seq.index], known - start
        detok = req.detoks[seq.index]
        lps = seq.logprobs if seq.params.logprobs is not None else None
        delta_text = detok.take(seq.is_finished)
        return CompletionOutput(
            index=seq.index, text=detok.text if whole else "",
            token_ids=seq.token_ids[start:known] if whole else [],
            logprobs=list(lps) if whole and lps is not None else None,
            finish_reason=seq.finish_reason,
            delta_text=delta_text,
            delta_token_ids=seq.token_ids[start + sent:known],
            delta_logprobs=lps[sent:] if lps is not None else [],
        )

    # -- offline use ------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order."""
        if isinstance(prompts, (str,)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        # Only last outputs are returned: the ones before need no cumulative fields.
        plist = [replace(sp, output_kind="delta") for sp in plist]
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            rid = f"generate-{id(prompts)}-{i}"
            if isinstance(p, str):
                self.add_request(rid, p, sp)
            else:
                self.add_request(rid, None, sp, prompt_token_ids=p)
            ids.append(rid)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        if not self.requests:   # the step queued behind the last tokens: nothing of it is wanted
            self.step()
        return [done[r] for r in ids]

    # -- introspection -------------------------------------------------------------------
    def cached_block_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` prefix-cache block hashes, most recently cached first."""
        return list(itertools.islice(reversed(self.kv.cache.cached_hashes()), limit))

    def window_block_hashes(self, hashes: list[bytes]) -> list[bytes]:
        """Those of `hashes` (from `cached_block_hashes`) whose blocks hold their window
        slots (none without a window pool)."""
        return self.kv.window_block_hashes(hashes)

    def stats(self) -> dict:
        usage = self.kv.usage()
        pc = self.kv.cache.stats
        held = usage.num_used_blocks
        per_block = self.runner.pool.bytes_per_block
        pool, window = self.kv.pool, self.kv.window
        per_slot = self.runner.window_pool.bytes_per_block if window else 0
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "preemptions": self.scheduler.num_preemptions,
            "num_total_blocks": usage.num_total_blocks,
            "num_free_blocks": usage.num_free_blocks,
            "num_cached_blocks": usage.num_cached_blocks,
            "num_blocks_held_by_requests": held,
            "block_size": self.config.block_size,
            "window_tokens": window.window if window else None,
            "window_slots_total": window.num_slots if window else 0,
            "window_slots_in_use": window.num_used if window else 0,
            "window_slot_evictions": window.evictions if window else 0,
            "kv_cache_bytes_total": self.kv_bytes,
            "kv_cache_bytes_in_use": held * per_block + (window.num_used * per_slot if window else 0),
            "kv_cache_bytes_peak": pool.peak_used * per_block + (window.peak_used * per_slot if window else 0),
            "kv_cache_bytes_saved_by_sharing": pool.num_shared_refs * per_block,
            "kv_cache_usage": held / usage.num_total_blocks,
            "prefix_cache_queries": pc.queries,
            "prefix_cache_hits": pc.hits,
            "prefix_cache_query_tokens": pc.query_tokens,
            "prefix_cache_hit_tokens": pc.hit_tokens,
            "prefix_cache_evictions": pc.evictions,
            "prompt_tokens": self._counters["prompt_tokens"],
            "generation_tokens": self._counters["generation_tokens"],
            "requests_finished": self._counters["requests_finished"],
            "step_failures": self._counters["step_failures"],
            "step_time_bounds_s": STEP_TIME_BOUNDS_S,
            "step_time_counts": list(self._step_counts),
            "step_seconds_total": self._step_seconds,
            "max_model_len": self.max_model_len,
            "attention_backend": self.runner.attention_backend,
            "device_memory_active_bytes": mx.get_active_memory(),
            "device_memory_cache_bytes": mx.get_cache_memory(),
            "device_memory_peak_bytes": mx.get_peak_memory(),
            "device_memory_cache_limit_bytes": self.buffer_cache_limit,
            "grammar_index_built": self._grammars is not None,
        }
