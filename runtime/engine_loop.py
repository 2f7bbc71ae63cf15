"""`EngineLoop`: the step loop around one `LLMEngine`, the same on a thread of the
server's process or in an engine process of its own (engine_process.py).

Commands come in between steps: `("add", request_id, kwargs)` (`LLMEngine.add_request`'s
arguments, and `stream_interval_s` and `max_chunks_per_s` for the `OutputPacer`),
`("abort", request_id)`, `("stop",)`. Each turn of the loop reports what happened as one
list of events: `("ready", info)` or `("start_failed", error)` once; then `("rejected",
request_id, error)`, `("outputs", [RequestOutput])`, `("failed", [request_id], reason)`,
`("stats", dict)`, `("hashes", [bytes])`; at the end `("dead", reason)` or
`("stopped",)`. A large step's outputs go earlier, with the stats, in a list of their
own (`_send_outputs`). `AsyncEngine` turns the events into its callers' streams.

Once the engine is ready, the vocabulary's grammar index is built on a thread beside the
loop (`LLMEngine.warm_grammars`). A structured output grammar not compiled before is
compiled on such a thread while the loop steps the other requests, and its request
joins the engine when it is ready: a large schema takes from tens to hundreds of
milliseconds (a 200-property one: 35 ms against the embedded model's 512 tokens, 284 ms
against 128k on the H100 host), which every running stream would otherwise wait out.
"""

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable

import mlx.core as mx

from .config import EngineConfig
from .engine import LLMEngine
from .output_pacer import OutputPacer

log = logging.getLogger(__name__)

HASH_SNAPSHOT_PERIOD_S = 0.5
HASH_SNAPSHOT_LIMIT = 8192
# A step that fails aborts its requests and the engine carries on; this many failures
# with no tokens delivered between them mean the engine cannot work: the loop stops.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# Idle this long, the loop gives MLX's buffer cache back. Freed step buffers stay cached
# for reuse, up to the engine's bound (`bound_buffer_cache`: gigabytes at hundreds of
# sequences), memory a Mac's other processes share. Not at once: at one request at a
# time, every request would pay the allocations again.
IDLE_CACHE_RELEASE_S = 2.0
GRAMMAR_THREADS = 2      # 0: compile on the loop itself (the A/B of bench/structured_output.py)
COMPILE_POLL_S = 0.005   # an idle loop waiting for a grammar still takes commands this often

Recv = Callable[[bool], list]          # block -> the commands that arrived (waits a while if block)
Emit = Callable[[list], None]


class EngineLoop:
    def __init__(self, config: EngineConfig, on_start: Callable[[], None] | None = None):
        """`on_start` runs first, before the model loads (to pin the loop's thread, say)."""
        self.config = config
        self.on_start = on_start
        self.engine: LLMEngine | None = None
        self.pacer = OutputPacer()
        self._stopping = False
        self._failures = 0
        self._hashes_at = 0.0
        self._busy_at = 0.0    # when the last step ran; 0 once the cache was released
        self._compiling: dict[str, tuple[Future, dict, tuple]] = {}   # request -> grammar, add kwargs, pace
        self._grammar_pool: ThreadPoolExecutor | None = None

    def run(self, recv: Recv, emit: Emit) -> None:
        try:
            self._run(recv, emit)
        finally:
            # MLX's streams are per thread, and MLX leaves their cleanup to the thread
            # that made them: left for interpreter exit, it aborts the process.
            mx.clear_streams()

    def _run(self, recv: Recv, emit: Emit) -> None:
        try:
            if self.on_start is not None:
                self.on_start()
            self.engine = engine = LLMEngine(self.config)
        except BaseException as e:
            emit([("start_failed", e)])
            return
        emit([("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                         "stats": engine.stats()})])
        engine.output_sink = lambda outputs: self._send_outputs(outputs, emit)
        engine.output_wanted = self.pacer.due
        if GRAMMAR_THREADS:
            self._grammars().submit(self._warm_grammars)
        try:
            while not self._stopping:
                events: list = []
                idle = not engine.has_unfinished_requests()
                if idle and self._compiling:
                    wait([c[0] for c in self._compiling.values()], COMPILE_POLL_S, FIRST_COMPLETED)
                for cmd in recv(idle and not self._compiling):
                    self._apply(cmd, events)
                self._admit_compiled(events)
                if engine.has_unfinished_requests():
                    self._step(events)
                    self._busy_at = time.monotonic()
                elif self._busy_at and time.monotonic() - self._busy_at > IDLE_CACHE_RELEASE_S:
                    mx.clear_cache()
                    self._busy_at = 0.0
                events.append(("stats", self._stats()))
                if time.monotonic() - self._hashes_at > HASH_SNAPSHOT_PERIOD_S:
                    hashes = engine.cached_block_hashes(HASH_SNAPSHOT_LIMIT)
                    events.append(("hashes", hashes, engine.window_block_hashes(hashes)))
                    self._hashes_at = time.monotonic()
                emit(events)
        except BaseException as e:
            log.exception("engine loop died")
            emit([("dead", repr(e))])
            return
        finally:
            engine.close()   # the engine's worker thread goes with its loop
            if self._grammar_pool is not None:
                self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        emit([("stopped",)])

    def _apply(self, cmd: tuple, events: list) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request_id, kwargs = cmd
            kwargs = dict(kwargs)
            pace = kwargs.pop("stream_interval_s", 0.0), kwargs.pop("max_chunks_per_s", 0.0)
            params = kwargs["params"]
            try:
                if (GRAMMAR_THREADS and params.structured_outputs is not None
                        and not self.engine.grammar_compiled(params)):
                    self._compile(request_id, kwargs, pace)
                    return
                self.engine.add_request(request_id, kwargs.pop("prompt"), kwargs.pop("params"), **kwargs)
            except Exception as e:
                events.append(("rejected", request_id, e))
                return
            self.pacer.add(request_id, *pace)
        elif kind == "abort":
            if self._compiling.pop(cmd[1], None) is None:
                self.engine.abort(cmd[1])
            self.pacer.drop(cmd[1])
        elif kind == "stop":
            self._stopping = True

    def _compile(self, request_id: str, kwargs: dict, pace: tuple) -> None:
        """Start compiling a request's grammar on a thread; the request joins the engine
        in `_admit_compiled`. Its other input is checked now."""
        kwargs["prompt_token_ids"] = self.engine.validate_request(
            kwargs["prompt"], kwargs["prompt_token_ids"], kwargs["params"])
        kwargs["arrival_time"] = time.monotonic()
        future = self._grammars().submit(self.engine.compile_grammar, kwargs["params"], kwargs["prompt_token_ids"])
        self._compiling[request_id] = future, kwargs, pace

    def _grammars(self) -> ThreadPoolExecutor:
        if self._grammar_pool is None:
            self._grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="grammar")
        return self._grammar_pool

    def _warm_grammars(self) -> None:
        """The grammar index, built beside the loop once it is ready (`warm_grammars`)."""
        try:
            self.engine.warm_grammars()
        except Exception as e:   # a structured request will get the error itself
            log.info("no grammar index for this tokenizer: %s", e)

    def _admit_compiled(self, events: list) -> None:
        for request_id, (future, kwargs, pace) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                self.engine.add_request(request_id, kwargs.pop("prompt"), kwargs.pop("params"),
                                        grammar=future.result(), **kwargs)
            except Exception as e:
                events.append(("rejected", request_id, e))
                continue
            self.pacer.add(request_id, *pace)

    def _stats(self) -> dict:
        """The engine's stats, with the requests whose grammars are compiling counted as
        waiting: they are, for routing and for the queue metrics."""
        stats = self.engine.stats()
        if self._compiling:
            stats["waiting"] += len(self._compiling)
        return stats

    def _send_outputs(self, outputs: list, emit: Emit) -> None:
        """A large step's outputs, as soon as the engine's worker thread has processed
        them, while the main thread queues the next step: paced, then emitted with the
        stats they leave behind, so a caller holding a request's last output sees it
        counted. Only one of the two threads emits at a time: the main thread emits
        between steps. (A small step's outputs come back from `step()` and leave with
        the turn's other events: one message a turn.)"""
        outputs = self._release(outputs)
        if outputs:
            emit([("outputs", outputs), ("stats", self._stats())])

    def _release(self, outputs: list) -> list:
        """A step's outputs, paced: the ones to send now. Outputs prove the engine works."""
        if not outputs:   # a step only launched proves nothing yet
            return outputs
        self._failures = 0
        return self.pacer.release(outputs, time.monotonic())

    def _step(self, events: list) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._failures += 1
            if self._failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            log.exception("engine step failed; aborting the requests it ran")
            failed = self.engine.recover()
            for rid in failed:
                self.pacer.drop(rid)
            events.append(("failed", failed, repr(e)))
            return
        outputs = self._release(outputs)
        if outputs:
            events.append(("outputs", outputs))
