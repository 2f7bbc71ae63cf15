"""`AsyncEngine`: the engine for asyncio servers.

The engine's step loop (`EngineLoop`) runs on a background thread, or with
`process=True` in an engine process of its own (engine_process.py), and owns all MLX
work. Callers' requests go to it as commands; its events come back as each caller's
stream in the caller's event loop. Cancelling a `generate()` iterator (a client went
away) aborts the request and frees its blocks. A step that raises (out of device
memory, say) fails the requests it was running with `EngineStepError` and the loop
goes on; if steps keep failing, or the loop or its process dies, every waiter gets
`EngineDeadError` and `check_health()` raises, so the replica can be restarted.
"""

import asyncio
import atexit
import itertools
import logging
import queue
import threading
import time
import weakref
from functools import partial
from typing import AsyncIterator, Callable

from .config import EngineConfig
from .engine_loop import EngineLoop
from .errors import DuplicateRequestError, EngineDeadError, EngineStepError, RequestAbortedError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)
_ids = itertools.count()


class _Stream:
    """One `generate()` call's mailbox, living in the caller's event loop. The engine
    loop paces what it sends (`OutputPacer`); outputs that arrive while the caller is
    busy merge into `pending`, so the caller always takes one output standing for all
    it missed."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: RequestOutput | BaseException | None = None
        self._fut: asyncio.Future | None = None

    def put(self, item) -> None:
        p = self.pending
        if isinstance(p, BaseException):
            return  # an error ends the stream; nothing after it matters
        self.pending = item if p is None or isinstance(item, BaseException) else p.absorb(item)
        if self._fut is not None and not self._fut.done():
            self._fut.set_result(None)

    async def get(self):
        """The next (merged) output or error."""
        while self.pending is None:
            self._fut = self.loop.create_future()
            await self._fut
        item, self.pending = self.pending, None
        return item


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, start_timeout: float = 600.0,
                 on_start: Callable[[], None] | None = None, process: bool = False,
                 env: dict[str, str] | None = None, stall_timeout_s: float | None = None):
        """`on_start` runs first where the loop runs, before the model loads (to pin
        that thread or process, say). `process` runs the loop in its own process, with
        `env`'s variables set there (a thread shares this process's environment).
        `stall_timeout_s`: `check_health` declares the engine dead when its loop has not
        come round for that long (see there); None never does."""
        if env and not process:
            raise ValueError("env applies to an engine process only (process=True)")
        self.config = config or EngineConfig()
        self.process = process
        self.stall_timeout_s = stall_timeout_s
        self._last_turn = time.monotonic()   # the loop's last message; it sends one every turn
        self._waiters: dict[str, _Stream] = {}
        self._error: str | BaseException | None = None
        self._info: dict = {}
        self._stats: dict = {}
        self._hashes: list[bytes] = []
        self._window_hashes: list[bytes] = []
        self._tokenizer = None
        self.live_streams = 0   # generate() calls in progress
        self._ready = threading.Event()
        if process:
            from .engine_process import EngineProcess
            self._core = EngineProcess(self.config, self._on_events, on_start, env)
            self._send = self._core.send
        else:
            self._loop = EngineLoop(self.config, on_start)
            self._commands: queue.Queue = queue.Queue()
            self._send = self._commands.put
            self._thread = threading.Thread(target=self._loop.run, args=(self._recv, self._on_events),
                                            name="mlx-engine", daemon=True)
            self._thread.start()
            self._stop_at_exit = partial(_stop_at_exit, weakref.ref(self))
            atexit.register(self._stop_at_exit)
        if not self._ready.wait(start_timeout):
            self.shutdown(timeout=1.0)
            raise TimeoutError("engine did not start in time")
        if self._error is not None:
            raise self._error if isinstance(self._error, BaseException) else EngineDeadError(self._error)

    # -- public API -----------------------------------------------------------------
    @property
    def engine(self):
        """The `LLMEngine` itself, where it runs on this process's thread."""
        if self.process:
            raise AttributeError("the engine runs in its own process")
        return self._loop.engine

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.process:
                from .models.loader import load_tokenizer
                self._tokenizer = load_tokenizer(self.config.model)
            else:
                self._tokenizer = self._loop.engine.tokenizer
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._info["max_model_len"]

    @property
    def vocab_size(self) -> int:
        return self._info["vocab_size"]

    async def generate(self, prompt: str | None = None, params: SamplingParams | None = None,
                       request_id: str | None = None, *, prompt_token_ids: list[int] | None = None,
                       priority: int = 0, cache_salt: str | None = None,
                       stream_interval_s: float = 0.0,
                       max_chunks_per_s: float = 0.0) -> AsyncIterator[RequestOutput]:
        """Yield a `RequestOutput` whenever the request has new tokens; the last one has
        `finished=True`. Invalid input raises the engine's typed error on first iteration.

        Outputs that pile up while the caller is busy come merged into one. With
        `stream_interval_s`, after the first output at most one merged output comes per
        interval (the final one at once; `math.inf`: the first and the last only):
        fewer, larger chunks for transports that pay per message. `max_chunks_per_s`
        caps the chunks of all paced streams together: the interval grows to
        `paced streams / max_chunks_per_s` when that is longer. The engine loop does
        the pacing (`OutputPacer`), so held outputs never leave it."""
        self.check_health()
        request_id = request_id or f"req-{next(_ids)}"
        stream = _Stream(asyncio.get_running_loop())
        if request_id in self._waiters:
            raise DuplicateRequestError(request_id)
        self._waiters[request_id] = stream
        submitted = time.monotonic()
        self._send(("add", request_id, dict(
            prompt=prompt, params=params or SamplingParams(), prompt_token_ids=prompt_token_ids,
            priority=priority, cache_salt=cache_salt, stream_interval_s=stream_interval_s,
            max_chunks_per_s=max_chunks_per_s)))
        finished = False
        self.live_streams += 1
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                m = item.metrics
                if m is not None and m.delivered_time is None:
                    m.submitted_time, m.delivered_time = submitted, time.monotonic()
                yield item
                if finished:
                    return
        finally:
            self.live_streams -= 1
            if self._waiters.get(request_id) is stream:
                self._waiters.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> dict:
        """The latest snapshot, refreshed after every step and every command."""
        return dict(self._stats)

    def cached_block_hashes(self, limit: int) -> list[bytes]:
        """Prefix-cache block hashes, most recently cached first (a snapshot at most
        `HASH_SNAPSHOT_PERIOD_S` old)."""
        return self._hashes[:limit]

    def window_block_hashes(self, limit: int) -> list[bytes]:
        """Those of the snapshot's hashes whose blocks hold their window slots (none
        without a window pool)."""
        return self._window_hashes[:limit]

    def check_health(self) -> None:
        """Raises `EngineDeadError` once the loop has stopped, or has stalled: with
        `stall_timeout_s`, a loop that has not come round for that long (it does at least
        every half second when idle, and after every step) is stuck in a step that will
        not return, a hung device or a deadlock, while its process looks alive. Its
        requests then get the error at once instead of waiting forever, and an engine
        process is killed, so that whatever replaces this engine starts clean."""
        alive = self._core.alive() if self.process else self._thread.is_alive()
        quiet = time.monotonic() - self._last_turn
        if self._error is None and alive and self.stall_timeout_s is not None and quiet > self.stall_timeout_s:
            self._on_events([("dead", f"the engine loop stalled: no step finished in {quiet:.0f} s "
                                      f"(stall_timeout_s {self.stall_timeout_s:g})")])
            if self.process:
                self._core.kill()
        if self._error is not None or not alive:
            raise EngineDeadError(f"engine loop stopped: {self._error!s}")

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.process:
            self._core.close(timeout)
        else:
            self._send(("stop",))
            self._thread.join(timeout)
            atexit.unregister(self._stop_at_exit)

    # -- the loop's side ---------------------------------------------------------------
    def _recv(self, block: bool) -> list:
        """The thread loop's commands: all that are queued, waiting a while for one if
        `block`."""
        try:
            cmds = [self._commands.get(timeout=0.5) if block else self._commands.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _on_events(self, events: list) -> None:
        """Runs on the loop's thread, or on the thread that receives from the engine
        process. Outputs reach each event loop with one wake-up per step, not one per
        request: a thread-safe call writes to the loop's self-pipe, and at hundreds of
        requests per step those writes and wake-ups would cost more than the step's
        scheduling."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        now = self._last_turn = time.monotonic()

        def deliver(w: _Stream | None, item) -> None:
            if w is not None:
                batches.setdefault(w.loop, []).append((w, item))

        for ev in events:
            kind = ev[0]
            if kind == "outputs":
                for out in ev[1]:
                    if out.metrics is not None and out.metrics.received_time is None:
                        out.metrics.received_time = now
                    deliver(self._waiters.pop(out.request_id, None) if out.finished
                            else self._waiters.get(out.request_id), out)
            elif kind == "stats":
                self._stats = ev[1]
            elif kind == "hashes":
                self._hashes, self._window_hashes = ev[1], ev[2]
            elif kind == "rejected":
                deliver(self._waiters.pop(ev[1], None), ev[2])
            elif kind == "failed":
                err = EngineStepError(f"the engine step running this request failed ({ev[2]}); "
                                      "it was aborted and its KV blocks freed")
                for rid in ev[1]:
                    deliver(self._waiters.pop(rid, None), err)
            elif kind == "ready":
                self._info = ev[1]
                self._stats = ev[1]["stats"]
                self._ready.set()
            elif kind == "start_failed":
                self._error = ev[1]
                self._ready.set()
            elif kind in ("dead", "stopped"):
                if kind == "dead":
                    self._error = self._error or ev[1]   # the first cause: a stall, then the kill
                    err = EngineDeadError(f"engine loop stopped: {ev[1]}")
                else:
                    err = RequestAbortedError("the engine shut down")
                self._ready.set()
                while self._waiters:
                    deliver(self._waiters.popitem()[1], err)
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass  # that loop is closed; nobody is listening


def _deliver(items: list) -> None:
    for stream, item in items:
        stream.put(item)


def _stop_at_exit(ref: weakref.ref) -> None:
    """An engine thread still running MLX when the interpreter exits can abort the
    process (MLX's per-thread streams outlive the runtime): stop it first."""
    engine = ref()
    if engine is not None and engine._thread.is_alive():
        engine.shutdown(timeout=5.0)
