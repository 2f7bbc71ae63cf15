"""`AsyncEngine`: the engine on one background thread, for asyncio servers.

The thread owns all MLX work: it builds the `LLMEngine`, and runs its step loop.
Callers talk to it through a command queue; outputs come back to each caller's event
loop. Cancelling a `generate()` iterator (a client went away) aborts the request and
frees its blocks. A step that raises (out of device memory, say) fails the requests it
was running with `EngineStepError` and the loop goes on; if steps keep failing, or the
loop dies otherwise, every waiter gets `EngineDeadError` and `check_health()` raises,
so the replica can be restarted.
"""

import asyncio
import itertools
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from .config import EngineConfig
from .engine import LLMEngine
from .errors import EngineDeadError, EngineStepError, RequestAbortedError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)
HASH_SNAPSHOT_PERIOD_S = 0.5
HASH_SNAPSHOT_LIMIT = 8192
# A step that fails aborts its requests and the engine carries on; this many failures
# with no tokens delivered between them mean the engine cannot work: the loop stops.
MAX_CONSECUTIVE_STEP_FAILURES = 3
_ids = itertools.count()


class _Stream:
    """One `generate()` call's mailbox, living in the caller's event loop. Outputs merge
    into `pending`; the caller is woken only when it should yield: at once for an
    error, the last output, or the first output after its interval (`due`); a
    pending output that is not yet due arms one timer. So at hundreds of streams,
    each engine step costs the loop a merge per stream, not a wake-up per stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: RequestOutput | BaseException | None = None
        self.due = 0.0
        self._fut: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None

    def put_threadsafe(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.put, item)
        except RuntimeError:
            pass  # the caller's loop is closed; nobody is listening

    def put(self, item) -> None:
        p = self.pending
        if isinstance(p, BaseException):
            return  # an error ends the stream; nothing after it matters
        self.pending = item if p is None or isinstance(item, BaseException) else p.absorb(item)
        self._wake()

    def _ready(self) -> bool:
        p = self.pending
        return p is not None and (isinstance(p, BaseException) or p.finished or self.loop.time() >= self.due)

    def _wake(self) -> None:
        if self._fut is None or self._fut.done():
            return
        if self._ready():
            self._fut.set_result(None)
        elif self.pending is not None and self._timer is None:
            self._timer = self.loop.call_at(self.due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._wake()

    async def get(self):
        """The next (merged) output or error, when it is due."""
        while not self._ready():
            self._fut = self.loop.create_future()
            self._wake()
            await self._fut
        item, self.pending = self.pending, None
        return item

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, start_timeout: float = 600.0,
                 on_start: Callable[[], None] | None = None):
        """`on_start` runs first on the engine thread, before the model loads (to pin
        that thread, say)."""
        self.config = config or EngineConfig()
        self._on_start = on_start
        self._commands: queue.Queue = queue.Queue()
        self._waiters: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._stats: dict = {}
        self._hashes: list[bytes] = []
        self._hashes_at = 0.0
        self.live_streams = 0   # generate() calls in progress
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            raise TimeoutError("engine did not start in time")
        if self._error is not None:
            raise self._error

    # -- public API -----------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    async def generate(self, prompt: str | None = None, params: SamplingParams | None = None,
                       request_id: str | None = None, *, prompt_token_ids: list[int] | None = None,
                       priority: int = 0, cache_salt: str | None = None,
                       stream_interval_s: float = 0.0,
                       max_chunks_per_s: float = 0.0) -> AsyncIterator[RequestOutput]:
        """Yield a `RequestOutput` whenever the request has new tokens; the last one has
        `finished=True`. Invalid input raises the engine's typed error on first iteration.

        Outputs that pile up while the caller is busy come merged into one. With
        `stream_interval_s`, after the first output at most one merged output is yielded
        per interval (the final one at once): fewer, larger chunks for transports that
        pay per message. `max_chunks_per_s` caps the chunks of all live streams together:
        the interval grows to `live streams / max_chunks_per_s` when that is longer."""
        self.check_health()
        request_id = request_id or f"req-{next(_ids)}"
        stream = _Stream(asyncio.get_running_loop())
        self._commands.put(("add", request_id, stream, dict(
            prompt=prompt, params=params or SamplingParams(), prompt_token_ids=prompt_token_ids,
            priority=priority, cache_salt=cache_salt)))
        finished = False
        self.live_streams += 1
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                interval = stream_interval_s
                if max_chunks_per_s > 0:
                    interval = max(interval, self.live_streams / max_chunks_per_s)
                stream.due = stream.loop.time() + interval
                yield item
                if finished:
                    return
        finally:
            stream.close()
            self.live_streams -= 1
            if not finished:
                self._commands.put(("abort", request_id, None, None))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None, None))

    def stats(self) -> dict:
        """The latest snapshot, refreshed after every step and every command."""
        return dict(self._stats)

    def cached_block_hashes(self, limit: int) -> list[bytes]:
        """Prefix-cache block hashes, most recently cached first (a snapshot at most
        `HASH_SNAPSHOT_PERIOD_S` old)."""
        return self._hashes[:limit]

    def check_health(self) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"engine loop stopped: {self._error!r}")

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(("stop", None, None, None))
        self._thread.join(timeout)

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._on_start is not None:
                self._on_start()
            self.engine = LLMEngine(self.config)
            self._stats = self.engine.stats()
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        failures = 0
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished_requests()
                self._drain(block=not busy)
                if self.engine.has_unfinished_requests():
                    try:
                        outputs = self.engine.step()
                        if outputs:   # a step only launched proves nothing yet
                            failures = 0
                    except Exception as e:
                        failures += 1
                        if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                            raise
                        log.exception("engine step failed; aborting the requests it ran")
                        self._fail(self.engine.recover(), e)
                        outputs = []
                    self._dispatch(outputs)
                self._stats = self.engine.stats()
                if time.monotonic() - self._hashes_at > HASH_SNAPSHOT_PERIOD_S:
                    self._hashes = self.engine.cached_block_hashes(HASH_SNAPSHOT_LIMIT)
                    self._hashes_at = time.monotonic()
        except BaseException as e:
            log.exception("engine loop died")
            self._error = e
            dead = EngineDeadError(f"engine loop stopped: {e!r}")
            for w in self._waiters.values():
                w.put_threadsafe(dead)
            self._waiters.clear()
            return
        finally:
            self.engine.close()   # the engine's worker thread goes with its loop
        gone = RequestAbortedError("the engine shut down")
        for w in self._waiters.values():
            w.put_threadsafe(gone)
        self._waiters.clear()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self._stats = self.engine.stats()

    def _handle(self, kind, request_id, stream, kwargs) -> None:
        if kind == "add":
            try:
                self.engine.add_request(request_id, kwargs.pop("prompt"), kwargs.pop("params"), **kwargs)
            except Exception as e:
                stream.put_threadsafe(e)
                return
            self._waiters[request_id] = stream
        elif kind == "abort":
            self.engine.abort(request_id)
            self._waiters.pop(request_id, None)
        elif kind == "stop":
            self._stopping = True

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        for rid in request_ids:
            w = self._waiters.pop(rid, None)
            if w is not None:
                w.put_threadsafe(EngineStepError(f"the engine step running this request failed ({error!r}); "
                                                 "it was aborted and its KV blocks freed"))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """One wake-up per event loop per step, not one per request: a thread-safe
        call writes to the loop's self-pipe, and at hundreds of requests per step those
        writes and wake-ups would cost more than the step's scheduling."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            w = self._waiters.get(out.request_id)
            if w is None:
                continue
            batches.setdefault(w.loop, []).append((w, out))
            if out.finished:
                del self._waiters[out.request_id]
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass  # that loop is closed; nobody is listening


def _deliver(items: list) -> None:
    for stream, item in items:
        stream.put(item)
