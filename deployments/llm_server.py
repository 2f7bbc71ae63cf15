"""`LLMServer`: one engine per Ray Serve replica.

It loads the model in its constructor and streams `RequestOutput`s to the ingress. A
bad request comes back as one `{"error": ...}` item rather than an exception, so the
ingress can answer 400 before it starts a stream; so does a request aborted by a failed
engine step or by an engine that died (`server_error`, which the ingress answers 503 with
Retry-After, or ends the stream with, while Serve's health check replaces the replica).
"""

import itertools
import logging
import math
import os
import sys
import uuid
from dataclasses import replace
from functools import partial
from pathlib import Path

from runtime import AsyncEngine, EngineConfig, SamplingParams
from runtime.errors import EngineDeadError, EngineStepError, InvalidRequestError, PromptTooLongError

log = logging.getLogger("ray.serve")

ROUTING_HASH_LIMIT = 4096   # block hashes a replica reports to the router, most recent first


def error_item(e: Exception) -> dict:
    if isinstance(e, (EngineStepError, EngineDeadError)):
        code = "engine_step_failed" if isinstance(e, EngineStepError) else "engine_dead"
        return {"error": {"message": str(e), "type": "server_error", "param": None, "code": code}}
    code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else None
    return {"error": {"message": str(e), "type": "invalid_request_error",
                      "param": getattr(e, "param", None), "code": code}}


def pin_current_thread(cpus: set[int]) -> bool:
    """Restrict the calling thread, and the threads it starts (MLX's among them), to
    `cpus`. False where the OS has no CPU affinity (macOS).

    Only the engine is pinned (its process's main thread, or its thread in the
    replica), never Ray's own threads (gRPC, event loops): they stay free to run on any
    core, and pinning them beside the engine starved the engine of requests. Where
    engines fill every core, Serve's nice-15 actors wait for CPU, and so do new requests
    (the cluster sections of bench/results/history.md measure both sides)."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    os.sched_setaffinity(0, cpus)
    return True


def renice_process(nice: int, pid: int | None = None) -> int | None:
    """Every thread of process `pid` (this one when None: Ray's gRPC and event-loop
    threads among them; threads started later inherit it from their starter) to `nice`
    where the OS allows, and the niceness that process then runs at (None where it
    cannot be read). On Linux niceness is per thread, so each one is set.

    Ray starts its workers at nice 15 (`RAY_worker_niceness`) so that its daemons keep
    their CPU. A replica there, and the engine it starts (its process or thread inherits
    the niceness), queue behind any nice-0 process: the engine's steps and MLX's CPU
    threads, and the replica's threads that carry each request to the engine and its
    tokens back. On the 2-core CI host, nice 0 for the engine cut TTFT p50 at one stream
    from 120 to 105 ms, and then for the replica too from 115 to 89 ms, at 4 streams from
    261 to 156 ms (bench/engine_nice_ab.py, alternating rounds). Lowering niceness needs
    privileges (root, CAP_SYS_NICE); without them both stay where Ray put them."""
    tasks = Path(f"/proc/{pid or 'self'}/task")
    for tid in ([int(t) for t in os.listdir(tasks)] if tasks.exists() else [pid or 0]):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass   # no privilege to lower it, or the thread has gone
    try:
        return os.getpriority(os.PRIO_PROCESS, pid or 0)
    except OSError:
        return None


def engine_env(threads: int | None, pin_cpus: int | None) -> dict[str, str]:
    """The engine process's `OMP_NUM_THREADS`. Ray sets it to 1 in the workers of a
    one-CPU actor (unless the driver's environment sets it), and the engine process
    would inherit that from the replica. On the H200, one stream, `max_num_seqs` 256,
    the served engine decoded at 5.1 ms a token with it against 3.5 ms for the bare
    engine, and at 2.6 ms served with 16 (the engine process then runs 36 threads, not
    6: a library in it sizes a pool by the variable; bench/results/history.md). The engine
    owns its host's accelerator, so it gets the CPUs it may use: `threads` if given,
    else `pin_cpus` when pinned, else the host's count."""
    return {"OMP_NUM_THREADS": str(threads or pin_cpus or os.cpu_count() or 1)}


def set_switch_interval(ms: float | None) -> None:
    """This process's thread switch interval, where `ms` is given. A replica runs Python
    on several threads (its event loop, Ray's callbacks, the engine's sender and
    receiver, tokenizers), and a thread that wants the GIL while another runs waits up
    to the interval (5 ms by default) before it is handed over."""
    if ms is not None:
        sys.setswitchinterval(ms / 1e3)


def rank_cpus(rank: int, per_replica: int, num_cpus: int) -> set[int]:
    return {(rank * per_replica + i) % num_cpus for i in range(per_replica)}


def _pin_engine_thread(rank: int, cpus: set[int]) -> None:
    """Runs where the engine loop runs, before the model loads."""
    log.info("LLMServer rank %d: engine pinned to CPUs %s: %s", rank, sorted(cpus), pin_current_thread(cpus))


class LLMServer:
    def __init__(self, engine_config: dict, stream_interval_s: float = 0.0,
                 pin_cpus: int | None = None, max_stream_chunks_per_s: float = 0.0,
                 engine_process: bool = True, engine_nice: int | None = 0,
                 engine_threads: int | None = None, stall_timeout_s: float | None = None,
                 switch_interval_ms: float | None = None):
        set_switch_interval(switch_interval_ms)
        rank = 0
        try:
            from ray import serve
            ctx = serve.get_replica_context()
            self.replica_id = ctx.replica_id.unique_id
            rank = getattr(ctx.rank, "rank", 0)
        except Exception:
            self.replica_id = uuid.uuid4().hex[:8]
        if engine_nice is not None:   # before the engine starts: it inherits the niceness
            got = renice_process(engine_nice)
            if got is not None and got != engine_nice:
                log.warning("LLMServer rank %d: the replica and its engine run at nice %d, not %d "
                            "(lowering it needs privileges; RAY_worker_niceness=0 before `ray start` "
                            "or `serve run` avoids it)", rank, got, engine_nice)
        on_start = None
        if pin_cpus:
            on_start = partial(_pin_engine_thread, rank, rank_cpus(rank, pin_cpus, os.cpu_count() or 1))
        env = engine_env(engine_threads, pin_cpus) if engine_process else None
        self.engine = AsyncEngine(EngineConfig(**engine_config), on_start=on_start, process=engine_process,
                                  env=env, stall_timeout_s=stall_timeout_s)
        self.stream_interval_s = stream_interval_s
        self.max_stream_chunks_per_s = max_stream_chunks_per_s
        self._ids = itertools.count()
        log.info("LLMServer %s ready: %s", self.replica_id, engine_config.get("model"))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None, whole: bool = False):
        """Streams the request's outputs. `whole` (the client did not ask for a stream):
        the first output and the last only, two Ray messages instead of one per
        interval; the first still comes at once, so a bad request fails before any wait."""
        request_id = f"{self.replica_id}-{next(self._ids)}"
        # Before the last output, only deltas travel to the ingress: the cumulative
        # text, token ids and logprobs, and the prompt, would otherwise go again with
        # every chunk (2.3 KB for a 512-token prompt and 100 tokens out, against
        # 0.3 KB), growing with the output. The ingress reads them from the last.
        params = replace(params, output_kind="delta")
        try:
            async for out in self.engine.generate(None, params, request_id,
                                                  prompt_token_ids=prompt_token_ids,
                                                  priority=priority, cache_salt=cache_salt,
                                                  stream_interval_s=math.inf if whole else self.stream_interval_s,
                                                  max_chunks_per_s=self.max_stream_chunks_per_s):
                if out.finished:
                    out.replica_id = self.replica_id
                    out.engine_stats = self.stats()
                yield out
        except (InvalidRequestError, EngineStepError, EngineDeadError) as e:
            yield error_item(e)

    def model_info(self) -> dict:
        return {"max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size,
                "block_size": self.engine.config.block_size}

    def stats(self) -> dict:
        return {"replica_id": self.replica_id, **self.engine.stats()}

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop has died, or
        stalled past `stall_timeout_s`."""
        self.engine.check_health()

    def health(self) -> dict:
        """The stats, for `/health`, once the engine has passed `check_health`: the stats
        alone are the engine's last report, which a dead or stalled engine still has."""
        self.check_health()
        return self.stats()

    def record_routing_stats(self) -> dict:
        """Load and a bounded set of the prefix-cache block hashes this replica holds,
        for prefix-aware routing; for a model whose sliding layers keep window slots,
        also the window's length and those of the hashes whose blocks hold their slots
        (a hit here is cut back to where its window's blocks do)."""
        try:
            self.engine.check_health()
        except EngineDeadError:
            return {"dead": True}
        s = self.engine.stats()
        stats = {"load": s["running"] + s["waiting"], "running": s["running"], "waiting": s["waiting"],
                 "kv_cache_usage": s["kv_cache_usage"], "block_size": s["block_size"],
                 "block_hashes": self.engine.cached_block_hashes(ROUTING_HASH_LIMIT)}
        if s.get("window_tokens"):
            stats["window_tokens"] = s["window_tokens"]
            stats["window_block_hashes"] = self.engine.window_block_hashes(ROUTING_HASH_LIMIT)
        return stats

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=1.0)
