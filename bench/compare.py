"""Side by side, in one run, on one model: our `serve run` app, our bare engine (no Ray,
no HTTP), `mlx_lm.server`, and vllm-mlx when it is installed; plus our app with the
prefix cache off, with its engine loop on a thread of the replica instead of its own
process, and (on CUDA) with gather instead of kernel attention. Opt-in
`ours-direct-ingress`: the app under Ray Serve's direct ingress, where the ingress
replica serves HTTP itself and no proxy relays requests and stream chunks; opt-in
`ours-haproxy`: the app under Ray Serve's HAProxy mode, where HAProxy takes the HTTP
port in front of the ingress replicas' own ports, in place of Serve's Python proxy
(the sweep, prefix and multi-turn; `ours-haproxy-no-apc`: prefix and multi-turn with the
prefix cache off, for APC on / off without the proxy's hop); opt-in `ours-2-ingress`:
the split app (below) with two ingress replicas behind the proxy, and
`ours-haproxy-2-ingress` behind HAProxy (which balances over both); opt-in
`ours-chunks-N`: the app with `max_stream_chunks_per_s: N` (0: no cap); opt-in
`ours-tokenize-threads-N`: the app with `tokenize_threads: N`; opt-in `ours-split`: the app as two deployments, the ingress calling `LLMServer` replicas
through Serve (`colocate: false`, as `configs/cluster.yaml` runs), where the shipped
`configs/config.yaml` colocates front and engine in one replica; opt-in `ours-ray-nice`:
the app with its engine left at the niceness Ray gives its workers (15) instead of 0;
opt-in `ours-separate-loop`: the app's handlers on an event loop of their own, Ray's
default, instead of the loop where Ray receives the replica's requests; opt-in
`ours-lean-serve`: every Ray process of the app with `LEAN_SERVE_ENV`; opt-in
`ours-grpc`: Serve's proxy calling the replica over gRPC instead of actor calls; opt-in
`ours-tokenize-inline`: every prompt tokenized on the replica's event loop, none on its
tokenizer threads (`tokenize_inline_chars`); opt-in `ours-switch-0.5`: the replica's
Python threads switching every 0.5 ms instead of 5 (`switch_interval_ms`); opt-in
`ours-no-token-cache`: every long prompt tokenized whole, none from the start it shares
with a recent one (`prompt_token_cache_tokens: 0`; prefix and multi-turn).

Every system gets the same requests from `serve_bench.py`, with EOS banned through
`logit_bias` so each request produces exactly its output length. Workloads:

- `random`: a concurrency sweep (burst arrivals, `--concurrency` cap), for throughput
  vs load and saturation;
- `random-poisson`: Poisson arrivals at the rate where `mlx_lm.server` delivers 80 % of
  its peak throughput in the sweep, for TTFT under a load everyone can carry (gamma
  arrivals at that rate with `--burstiness` other than 1, as in `serve_bench.py`);
- `prefix`: requests sharing a few long prefixes (APC on vs off); with several
  `--prefix-len`, one workload per length (`prefix`, then `prefix-<length>`);
- `multi-turn`: chat sessions that resend their history;
- `kv-memory`: in-process, closed loop, KV bytes held per step, our paged pool vs
  mlx-lm's `BatchGenerator` (the batcher `mlx_lm.server` runs) on the same requests.

Writes `bench/results/compare_<tag>.json` (a list of rows) and `compare_<tag>.png`.

    python bench/compare.py                                   # CPU, embedded model
    python bench/compare.py --model llama-1b --tag gpu --input-len 512 --output-len 128 \\
        --concurrency 1 8 32 64 128 256 --kv-cache-gb 16 --max-num-batched-tokens 4096
"""

import argparse
import asyncio
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from bench import serve_bench as sb  # noqa: E402
from bench.bench_continuous_vs_static import portable_args, resolve_model, run_meta  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
KV_GAUGES = ("kv_cache_bytes_in_use", "kv_cache_bytes_saved_by_sharing", "num_requests_running")


@dataclass
class Target:
    """A running system: how to reach it, and (ours only) how to read its KV telemetry."""
    name: str
    make_backend: callable
    sampler: callable = None
    note: str = ""
    log: Path | None = None     # a subprocess server's log: its tail explains failed requests


# -- the systems ---------------------------------------------------------------------------
def our_app_config(model: str, engine: dict, **app_args) -> dict:
    """The shipped `configs/config.yaml` application, on `model`, with `engine` and
    `app_args` on top."""
    app = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())["applications"][0]
    args = dict(app["args"])
    args.update(model=model, served_model_name="default", engine={**args.get("engine", {}), **engine},
                **app_args)
    return {**app, "args": args}


def _metrics_sampler(base: str):
    from tests.serving import metric

    def sample() -> dict:
        text = httpx.get(base + "/metrics", timeout=10).text
        return {**{k: metric(text, k) or 0.0 for k in KV_GAUGES}, "step_time_counts": step_time_counts(text)}
    return sample


def step_time_counts(metrics_text: str) -> list[int]:
    """The engine step-duration histogram of a `/metrics` page, as a count per bucket."""
    cumulative = [float(v) for v in re.findall(
        r"^mlx_paged_serve:engine_step_duration_seconds_bucket\{[^}]*\} ([0-9.e+-]+)$", metrics_text, re.M)]
    return [int(b - a) for a, b in zip([0.0, *cumulative], cumulative)]


# Three of the settings Ray Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED turns on, without its
# gRPC and direct ingress (measured on their own): Serve's router on its caller's loop,
# request-path logs buffered, no logs to stderr.
LEAN_SERVE_ENV = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0", "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
                  "RAY_SERVE_LOG_TO_STDERR": "0"}
TWO_INGRESS = {"num_replicas": 2, "max_ongoing_requests": 1024, "ray_actor_options": {"num_cpus": 0.2}}


@dataclass(frozen=True)
class Variant:
    """Our app with one thing changed: `label` names its rows' workload, `setting` is
    recorded in each row, `engine` updates the engine settings and `serve` is the rest
    of `ours()`'s arguments (front, env, app arguments). `workloads`: those it runs (of
    those asked for); most vary the serving path, which the sweep measures."""

    label: str
    setting: dict
    serve: dict
    engine: dict | None = None
    workloads: tuple[str, ...] = ("random",)

    def app(self, model: str, engine: dict, name: str, extra: dict):
        """`ours()` with this variant's changes, its target named `name`."""
        return ours(model, {**engine, **(self.engine or {})}, name, extra, **self.serve)


VARIANTS = {
    "ours-gather": Variant("attention=gather", {"attention_backend": "gather"}, {},
                           {"attention_backend": "gather"}),
    "ours-direct-ingress": Variant("direct ingress", {"direct_ingress": True}, {"front": "direct"}),
    "ours-haproxy": Variant("HAProxy", {"front": "haproxy"}, {"front": "haproxy"},
                            workloads=("random", "prefix", "multi-turn")),
    "ours-haproxy-no-prefill-kernel": Variant("HAProxy, prefill kernel off",
                                              {"front": "haproxy", "prefill_kernel": False},
                                              {"front": "haproxy"}, {"prefill_kernel": False},
                                              workloads=("prefix", "multi-turn")),
    "ours-haproxy-no-apc": Variant("HAProxy, APC off", {"front": "haproxy", "enable_prefix_caching": False},
                                   {"front": "haproxy"}, {"enable_prefix_caching": False},
                                   workloads=("prefix", "multi-turn")),
    "ours-grpc": Variant("proxy to replicas over gRPC", {"front": "grpc"}, {"front": "grpc"},
                         workloads=("random", "prefix")),
    "ours-2-ingress": Variant("2 ingress replicas", {"front": "proxy", "ingress_replicas": 2},
                              {"colocate": False, "ingress": TWO_INGRESS}),
    "ours-haproxy-2-ingress": Variant("HAProxy, 2 ingress replicas", {"front": "haproxy", "ingress_replicas": 2},
                                      {"front": "haproxy", "colocate": False, "ingress": TWO_INGRESS}),
    "ours-split": Variant("ingress and LLMServer apart", {"colocate": False}, {"colocate": False}),
    "ours-lean-serve": Variant("lean Serve settings", {"lean_serve": True}, {"env": LEAN_SERVE_ENV},
                               workloads=("random", "prefix")),
    "ours-separate-loop": Variant("handlers on a loop of their own", {"share_replica_loop": False},
                                  {"share_replica_loop": False}),
    "ours-ray-nice": Variant("engine at Ray's nice 15", {"engine_nice": None}, {"engine_nice": None}),
    "ours-engine-thread": Variant("engine on a thread", {"engine_process": False}, {"engine_process": False}),
    "ours-engine-threads-1": Variant("engine at OMP_NUM_THREADS=1", {"engine_threads": 1}, {"engine_threads": 1}),
    "ours-tokenize-inline": Variant("tokenized on the loop", {"tokenize_inline_chars": 1 << 30},
                                    {"tokenize_inline_chars": 1 << 30}, workloads=("random", "prefix")),
    "ours-no-token-cache": Variant("prompt token cache off", {"prompt_token_cache_tokens": 0},
                                   {"prompt_token_cache_tokens": 0}, workloads=("prefix", "multi-turn")),
    "ours-switch-0.5": Variant("0.5 ms thread switch interval", {"switch_interval_ms": 0.5},
                               {"switch_interval_ms": 0.5}, workloads=("random", "prefix")),
}


SYSTEMS = ("mlx_lm.server", "ours", "ours-bare-engine", "ours-no-apc", "vllm-mlx")


def app_variant(name: str) -> Variant | None:
    """The variant of our app a system name stands for (`ours-chunks-N`: the app with
    `max_stream_chunks_per_s: N`; `ours-tokenize-threads-N`: with `tokenize_threads: N`);
    None for any other system."""
    try:
        if name.startswith("ours-chunks-"):
            cap = float(name.removeprefix("ours-chunks-"))
            return Variant(f"{cap:g} chunks/s", {"max_stream_chunks_per_s": cap}, {"max_stream_chunks_per_s": cap})
        if name.startswith("ours-tokenize-threads-"):
            n = int(name.removeprefix("ours-tokenize-threads-"))
            return Variant(f"{n} tokenizer threads", {"tokenize_threads": n}, {"tokenize_threads": n},
                           workloads=("random", "prefix")) if n >= 1 else None
    except ValueError:
        return None
    return VARIANTS.get(name)


@contextmanager
def ours(model: str, engine: dict, name: str, extra: dict, front: str = "proxy", env: dict | None = None,
         **app_args):
    from tests.serving import ServeRun

    run = ServeRun([our_app_config(model, engine, **app_args)], timeout=900, front=front, env=env, pgids=_started)
    try:
        yield Target(name, lambda: sb.HTTPBackend(run.base, "default", extra), _metrics_sampler(run.base),
                     f"serve run, start-up {run.startup_s:.0f} s")
    finally:
        run.stop()
        for proc in ("ServeReplica:", "runtime.engine_process"):
            _wait_gone(proc, 120)   # their device memory must be free before the next system


def _wait_gone(pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and subprocess.run(["pgrep", "-f", pattern], capture_output=True).stdout:
        time.sleep(0.5)


@contextmanager
def bare_engine(model: str, engine: dict, extra: dict, name: str = "ours-bare-engine"):
    """The replica's engine without Ray Serve and HTTP: the same `AsyncEngine` with its
    loop in an engine process of its own, driven from this process's event loop. (With
    the loop on a thread here instead, the client's per-token work for hundreds of
    streams and the engine's host work share one GIL, and the anchor itself slows.)"""
    from deployments.app import AppArgs
    from runtime import AsyncEngine, EngineConfig

    eng = AsyncEngine(EngineConfig(model=model, **engine), process=True)
    # The app's default output pacing, so that the two differ by Ray Serve and HTTP alone.
    fields = AppArgs.model_fields
    pace = fields["stream_interval_ms"].default / 1e3, fields["max_stream_chunks_per_s"].default

    def sample() -> dict:
        s = eng.stats()
        return {"kv_cache_bytes_in_use": s["kv_cache_bytes_in_use"], "num_requests_running": s["running"],
                "kv_cache_bytes_saved_by_sharing": s["kv_cache_bytes_saved_by_sharing"],
                "step_time_counts": s["step_time_counts"]}
    try:
        yield Target(name, lambda: sb.EngineBackend(eng, extra, *pace), sample, "AsyncEngine, engine process")
    finally:
        eng.shutdown()


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready: {log.read_text()[-3000:]}")


@contextmanager
def subprocess_server(name: str, cmd: list[str], port: int, model_name: str, extra: dict):
    log = Path(tempfile.mkdtemp(prefix="mps-compare-")) / f"{name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _started.add(proc.pid)
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", proc, log, 900)
        yield Target(name, lambda: sb.HTTPBackend(f"http://127.0.0.1:{port}", model_name, extra),
                     note=" ".join(Path(c).name if i == 0 else c for i, c in enumerate(cmd[:3])), log=log)
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        _started.discard(proc.pid)


# A run stopped with SIGTERM (`timeout`, a job scheduler) must still stop the servers it
# started: an orphaned one keeps its device memory and starves the next run. The exit
# goes through the `finally` blocks that stop them; should that hang (a cleanup waiting
# on a connection that never ends), whatever is left is killed after `SIGTERM_GRACE_S`.
SIGTERM_GRACE_S = 45.0
_started: set[int] = set()   # the process groups of the servers this run started
_stopping = threading.Event()


def _on_sigterm(signum, frame) -> None:
    if _stopping.is_set():   # a second SIGTERM must not cut the first one's cleanup short
        return
    _stopping.set()
    timer = threading.Timer(SIGTERM_GRACE_S, _kill_and_exit)
    timer.daemon = True   # a clean exit does not wait for it
    timer.start()
    sys.exit(128 + signal.SIGTERM)


def _kill_and_exit() -> None:
    for pgid in list(_started):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(128 + signal.SIGTERM)


def mlx_lm_server(model: str, max_concurrency: int, extra: dict):
    from tests.serving import free_port

    port = free_port()
    # mlx_lm.server loads whatever `model` a request names; naming its own path keeps it on it.
    return subprocess_server("mlx_lm.server", [
        sys.executable, "-m", "mlx_lm.server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
        "--decode-concurrency", str(max_concurrency), "--max-tokens", "4096"], port, model, extra)


def vllm_mlx_server(exe: str, model: str, max_concurrency: int, extra: dict):
    from tests.serving import free_port

    port = free_port()
    return subprocess_server("vllm-mlx", [
        exe, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "default",
        "--continuous-batching", "--max-num-seqs", str(max_concurrency)], port, "default", extra)


def find_vllm_mlx(arg: str | None) -> tuple[str | None, str]:
    """The vllm-mlx executable, or None and why not."""
    exe = arg or shutil.which("vllm-mlx")
    if exe and Path(exe).exists():
        return exe, ""
    return None, ("vllm-mlx is not installed here. It pins mlx-lm<0.32 and pulls in torch, torchvision "
                  "and gradio, so it cannot share this environment; install it in its own venv "
                  "(`python -m venv v && v/bin/pip install vllm-mlx 'mlx[cpu]'`) and pass --vllm-mlx v/bin/vllm-mlx.")


# -- measuring -----------------------------------------------------------------------------
def host_speed(seconds: float = 0.5) -> float:
    """GFLOP/s of a 256x256 fp32 matmul on the default device: a yardstick taken before
    and after each system, so a run on a shared host whose speed moved says so."""
    import mlx.core as mx

    a = mx.random.normal((256, 256))
    mx.eval(a)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        mx.eval(a @ a)
        n += 1
    return 2 * 256 ** 3 * n / (time.perf_counter() - t0) / 1e9


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat; None where there is none.
    Steal is the time a virtual machine's CPUs waited for the hypervisor."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (f[7] if len(f) > 7 else 0), sum(f)


def host_during(before: tuple | None, speed_before: float) -> dict:
    """What the host did while one system ran: its steal share and the yardstick
    before and after."""
    after = cpu_ticks()
    out = {"gflops_before": speed_before, "gflops_after": host_speed()}
    if before and after and after[1] > before[1]:
        out["steal_frac"] = (after[0] - before[0]) / (after[1] - before[1])
    return out


def measure(target: Target, requests, rate=math.inf, concurrency=None, seed=0, burstiness=1.0) -> dict:
    async def go():
        backend = target.make_backend()
        try:
            return await sb.run(backend, requests, rate, concurrency, seed, progress=False,
                                sampler=target.sampler, burstiness=burstiness)
        finally:
            await backend.aclose()
    return asyncio.run(go())


def to_row(target: Target, workload: str, s: dict, **extra) -> dict:
    row = {"system": target.name, "workload": workload, "request_rate": s["request_rate"],
           "concurrency": s["max_concurrency"],
           "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p95_s": s["ttft_s"]["p95"], "ttft_p99_s": s["ttft_s"]["p99"],
           "ttft_mean_s": s["ttft_s"]["mean"],
           "tpot_p50_s": s["tpot_s"]["p50"], "tpot_p95_s": s["tpot_s"]["p95"],
           "itl_p50_s": s["itl_s"]["p50"], "itl_p95_s": s["itl_s"]["p95"], "itl_p99_s": s["itl_s"]["p99"],
           "e2el_p50_s": s["e2el_s"]["p50"], "e2el_p95_s": s["e2el_s"]["p95"],
           "output_tok_s": s["output_throughput"], "request_throughput": s["request_throughput"],
           "completed": s["completed"], "failed": s["failed"], "errors": s["errors"],
           "num_requests": s["num_requests"], "prompt_tokens": s["total_input_tokens"],
           "cached_prompt_tokens": s["cached_prompt_tokens"], "duration_s": s["duration_s"],
           "client_cpu_frac": s["client_cpu_frac"],
           "ttfts_s": [round(t, 5) for t in s["ttfts"]], **extra}
    if s.get("server_timing_s"):     # our app's TTFT split (Server-Timing): in the replica, and outside it
        row["ttft_split_p50_s"] = {k: d["p50"] for k, d in s["server_timing_s"].items()}
        # Medians of skewed parts need not add up to the TTFT's median; the means add up
        # to `ttft_mean_s` (`request` + `first_token` + `outside`).
        row["ttft_split_mean_s"] = {k: d["mean"] for k, d in s["server_timing_s"].items()}
    samples = [x for x in s.get("samples") or [] if x]
    busy = [x for x in samples if x["num_requests_running"] > 0]
    if samples:
        row["kv_bytes_peak_sampled"] = max(x["kv_cache_bytes_in_use"] for x in samples)
        row["kv_bytes_steady"] = float(np.median([x["kv_cache_bytes_in_use"] for x in busy])) if busy else 0.0
        row["kv_bytes_saved_by_sharing_peak"] = max(x["kv_cache_bytes_saved_by_sharing"] for x in samples)
        row.update(step_times(samples[0].get("step_time_counts"), samples[-1].get("step_time_counts")))
    if s["failed"] and target.log is not None:
        row["server_log_tail"] = target.log.read_text(errors="replace")[-2000:]
    fail = f"  FAILED {s['failed']}: {s['errors'][:1]}" if s["failed"] else ""
    print(f"{target.name:>18} {workload:>16} c={str(row['concurrency']):>4} rate={str(row['request_rate'])[:6]:>6}"
          f" {row['output_tok_s']:9.1f} tok/s  TTFT p50 {_ms(row['ttft_p50_s'])} p95 {_ms(row['ttft_p95_s'])}"
          f"  TPOT p50 {_ms(row['tpot_p50_s'])}  client CPU {row['client_cpu_frac'] or 0:4.0%}{fail}", flush=True)
    return row


def step_times(first: list[int] | None, last: list[int] | None) -> dict:
    """The engine steps between two samples by duration (`STEP_TIME_BOUNDS_S` buckets),
    and how many took over 160 ms: such a step holds up every request waiting for the
    engine loop's turn (in `to_engine` of the TTFT split)."""
    from runtime.engine import STEP_TIME_BOUNDS_S

    if not first or not last or len(first) != len(last):
        return {}
    counts = [b - a for a, b in zip(first, last)]
    slow = sum(n for lower, n in zip(STEP_TIME_BOUNDS_S, counts[1:]) if lower >= 0.16)
    return {"engine_step_time_bounds_s": list(STEP_TIME_BOUNDS_S), "engine_step_time_counts": counts,
            "engine_steps_over_160ms": slow}


def _ms(x) -> str:
    return f"{x * 1e3:8.1f}ms" if x is not None else "     n/a  "


def warm_up(target: Target, wl: "Workloads", plan: set[str] = frozenset({"random"}),
            points: list[int] | None = None, lengths: range | None = None) -> None:
    """A short pass over the shapes each planned workload runs, so one-off kernel
    compilation for each batch shape is not timed (MLX's CUDA backend compiles on first
    use; a prompt whose prefix is cached runs a new attention shape, a few new tokens over
    a long context). The prefix passes have the measured one's shape (as many families,
    a cold wave then hits), then hits at lower concurrency (`warm_prefix_concurrency`).
    Poisson arrivals never have more than `poisson_prompts` requests in flight, so they
    warm no sweep point above that (mlx_lm.server stops generating after a 256-stream
    burst). Its text is its own: nothing it caches is hit later.
    `points`: the sweep points to warm instead (a variant's own sweep); `lengths`: which
    of the `--prefix-len` indices to warm (all by default)."""
    a = wl.a
    for c in warm_sweep(plan, a) if points is None else points:
        measure(target, sb.random_workload(wl.src(7 + c), c, a.input_len, 4, a.range_ratio), concurrency=c)
    if "prefix" in plan:
        for i in lengths or range(len(a.prefix_len)):
            for c in warm_prefix_concurrency(a.prefix_concurrency):
                reqs = sb.prefix_workload(wl.src(9000 + 100 * i), 2 * c, a.prefix_len[i], a.num_prefixes,
                                          a.suffix_len, a.prefix_output_len)
                measure(target, reqs, concurrency=c)
    if "multi-turn" in plan:
        reqs = sb.multi_turn_workload(wl.src(9001), a.num_sessions, 2, a.turn_len, 4)
        measure(target, reqs, concurrency=a.num_sessions)


def warm_prefix_concurrency(c: int) -> list[int]:
    """The prefix warm-up's passes: the measured concurrency (a cold wave, then hits),
    then each power of two below it (hits). How many hit prompts prefill in one step
    depends on how their arrivals split over steps, and on CUDA each batch size is a
    new attention shape whose first use builds a plan (tens of milliseconds): the
    measured waves of 8 also run as 1+7 or 3+5, batch buckets 1 and 4."""
    return [c] + [1 << i for i in range((c - 1).bit_length()) if 1 << i < c]


def warm_sweep(plan: set[str], args) -> list[int]:
    """The sweep points a warm-up runs: all for the sweep itself; for Poisson arrivals,
    those it can reach (at most `poisson_prompts` in flight); none otherwise."""
    if "random" in plan:
        return list(args.concurrency)
    if "poisson" in plan:
        return [c for c in args.concurrency if c <= args.poisson_prompts]
    return []


class Workloads:
    """The same requests for every system: each is rebuilt from its own seed, and no
    two workloads (or sweep points) share text, so no cache carries over between them."""

    def __init__(self, tokenizer, args):
        self.tok, self.a = tokenizer, args

    def src(self, seed):
        return sb.TextSource(self.tok, seed)

    def random(self, c):
        n = max(self.a.min_prompts, self.a.prompts_per_stream * c)
        return sb.random_workload(self.src(1000 + c), n, self.a.input_len, self.a.output_len, self.a.range_ratio)

    def poisson(self):
        return sb.random_workload(self.src(2000), self.a.poisson_prompts, self.a.input_len, self.a.output_len,
                                  self.a.range_ratio)

    def prefixes(self, lengths: range | None = None) -> list[tuple[str, int, list]]:
        """One prefix workload per `--prefix-len` (those at the indices `lengths`, all by
        default), each as (row name, length, requests): the first is `prefix`, the others
        `prefix-<length>`. Each length has text of its own, so a longer prefix never hits
        the blocks a shorter one cached."""
        a = self.a
        return [("prefix" if i == 0 else f"prefix-{a.prefix_len[i]}", a.prefix_len[i],
                 sb.prefix_workload(self.src(3000 + 100 * i), a.prefix_prompts, a.prefix_len[i], a.num_prefixes,
                                    a.suffix_len, a.prefix_output_len))
                for i in lengths or range(len(a.prefix_len))]

    def multi_turn(self):
        a = self.a
        return sb.multi_turn_workload(self.src(4000), a.num_sessions, a.turns, a.turn_len, a.turn_output_len)


def _plan_of(workload: str) -> str:
    """The workload a row's name stands for: `prefix (HAProxy)` is a variant's prefix row,
    `prefix-7680` the prefix workload at a second `--prefix-len`."""
    base = workload.split(" (")[0]
    if base.startswith("prefix-"):
        return "prefix"
    return {"random-poisson": "poisson"}.get(base, base)


def run_system(target: Target, wl: Workloads, args, plan: set[str], rate: float | None,
               keep: Callable[[dict], None], label: str | None = None, lengths: range | None = None,
               **setting) -> None:
    """Runs `plan`'s workloads (those asked for) on `target`, handing each row to `keep`
    as soon as it is measured. `label`: a variant of our app, whose rows are named
    `<workload> (label)`, sweep the variant's concurrency points and record `setting`.
    `lengths`: the `--prefix-len` indices its prefix workloads run (all by default)."""
    plan = plan & set(args.workloads)
    if not plan:
        return
    name = (lambda w: f"{w} ({label})") if label else (lambda w: w)  # noqa: E731
    points = (args.variant_concurrency if label else None) or args.concurrency
    t0 = time.perf_counter()
    warm_up(target, wl, plan, points=points if label and "random" in plan else None, lengths=lengths)
    print(f"   {target.name}: warm-up {time.perf_counter() - t0:.0f} s", flush=True)
    if "random" in plan:
        for c in points:
            keep(to_row(target, name("random"), measure(target, wl.random(c), concurrency=c), **setting))
    if "poisson" in plan and rate:
        s = measure(target, wl.poisson(), rate=rate, seed=1, burstiness=args.burstiness)
        keep(to_row(target, name("random-poisson"), s, burstiness=s["burstiness"], **setting))
    if "prefix" in plan:
        for workload, length, reqs in wl.prefixes(lengths):
            keep(to_row(target, name(workload), measure(target, reqs, concurrency=args.prefix_concurrency),
                        prefix_len=length, num_prefixes=args.num_prefixes, **setting))
    if "multi-turn" in plan:
        keep(to_row(target, name("multi-turn"), measure(target, wl.multi_turn(), concurrency=args.num_sessions),
                    sessions=args.num_sessions, turns=args.turns, **setting))


def mlx_lm_sweep(rows: list[dict]) -> list[dict]:
    """mlx_lm.server's sweep points that completed every request (else those that
    completed some): a point that dropped requests is no peak, one with none is no point."""
    sweep = [r for r in rows if r["system"] == "mlx_lm.server" and r["workload"] == "random"]
    return [r for r in sweep if not r["failed"]] or [r for r in sweep if r["output_tok_s"] > 0]


def poisson_rate(rows: list[dict], output_len: int) -> tuple[float, float]:
    """The request rate at which mlx_lm.server would deliver 80 % of the peak output
    throughput it reached in the sweep, and that peak."""
    peak = max(r["output_tok_s"] for r in mlx_lm_sweep(rows))
    return 0.8 * peak / output_len, peak


# -- KV memory, in-process -------------------------------------------------------------------
def kv_memory_rows(model_path: str, engine_cfg: dict, args) -> list[dict]:
    """Closed loop at each concurrency on the same mixed-length requests: KV bytes our
    pool holds for requests vs what mlx-lm's BatchGenerator allocates (its caches pad
    every sequence of a batch to the longest and grow in 256-token steps)."""
    from bench.bench_continuous_vs_static import run_mlx_lm, run_ours, workload
    from mlx_lm import load
    from runtime import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=model_path, **engine_cfg))
    plain, _ = load(model_path)   # mlx-lm's own copy, as loaded (the engine's has fused projections)
    rows = []
    for c in args.concurrency:
        spec = argparse.Namespace(fixed=False, prompt_len=args.input_len, gen_len=args.output_len)
        reqs = workload(max(c, args.prompts_per_stream * c), spec, engine.vocab_size, seed=5000 + c)
        ours_kv, dense_kv = [], []
        engine.kv.cache.reset()
        r_ours = run_ours(engine, reqs, c, "ours",
                          on_step=lambda: ours_kv.append(engine.stats()["kv_cache_bytes_in_use"]))
        r_dense = run_mlx_lm(plain, reqs, c, on_step=lambda g: dense_kv.append(g.prompt_cache_nbytes))
        for name, r, kv in (("ours-bare-engine", r_ours, ours_kv), ("mlx_lm.server", r_dense, dense_kv)):
            rows.append({"system": name, "workload": "kv-memory", "request_rate": None, "concurrency": c,
                         "ttft_p50_s": r["ttft_p50_s"], "ttft_p95_s": r["ttft_p95_s"], "tpot_p50_s": None,
                         "output_tok_s": r["output_tok_s"], "kv_bytes_peak": float(max(kv)),
                         "kv_bytes_steady": float(np.median(kv)),
                         "kv_layout": "paged blocks" if name.startswith("ours") else "dense (mlx-lm BatchKVCache)",
                         "measured_in": "LLMEngine, in-process" if name.startswith("ours")
                         else "mlx_lm BatchGenerator (mlx_lm.server's batcher), in-process"})
        print(f"kv-memory c={c:<4} paged peak {max(ours_kv) / 2**20:8.1f} MiB   dense peak "
              f"{max(dense_kv) / 2**20:8.1f} MiB", flush=True)
    return rows


# -- report --------------------------------------------------------------------------------
def pick(rows, system, workload, concurrency=None):
    for r in rows:
        if r["system"] == system and r["workload"] == workload and (concurrency is None or r["concurrency"] == concurrency):
            return r
    return None


def headline(rows: list[dict], args) -> dict:
    """The issue's four comparisons, as ratios. A comparison whose rows are missing or
    failed (a partial or merged run) is left out rather than guessed."""
    h = {}
    ok = lambda r: r is not None and r["ttft_p50_s"] is not None  # noqa: E731
    sweep = lambda s: [r for r in rows if r["system"] == s and r["workload"] == "random" and ok(r)]  # noqa: E731
    ml, us, bare = mlx_lm_sweep(rows), sweep("ours"), sweep("ours-bare-engine")
    if ml and us:
        peak_ml = max(r["output_tok_s"] for r in ml)
        c80 = min(r["concurrency"] for r in ml if r["output_tok_s"] >= 0.8 * peak_ml)
        h["mlx_lm_peak_output_tok_s"] = peak_ml
        h["ours_peak_output_tok_s"] = max(r["output_tok_s"] for r in us)
        h["saturation_throughput_ratio"] = h["ours_peak_output_tok_s"] / peak_ml
        h["load_80pct_concurrency"] = c80
        o, m = pick(rows, "ours", "random", c80), pick(rows, "mlx_lm.server", "random", c80)
        if ok(o) and ok(m):
            h["ttft_p50_ratio_at_80pct_concurrency"] = o["ttft_p50_s"] / m["ttft_p50_s"]
    po, pm = pick(rows, "ours", "random-poisson"), pick(rows, "mlx_lm.server", "random-poisson")
    if ok(po) and ok(pm):
        h["poisson_rate_req_s"] = pm["request_rate"]
        h["ttft_p50_ratio_at_80pct_rate"] = po["ttft_p50_s"] / pm["ttft_p50_s"]
    both = sorted({r["concurrency"] for r in us} & {r["concurrency"] for r in bare})
    if both:
        o, b = (pick(rows, "ours", "random", both[-1]), pick(rows, "ours-bare-engine", "random", both[-1]))
        h["serve_overhead_throughput"] = 1 - o["output_tok_s"] / b["output_tok_s"]
        h["serve_overhead_ttft_s_at_top_load"] = o["ttft_p50_s"] - b["ttft_p50_s"]
        o, b = (pick(rows, "ours", "random", both[0]), pick(rows, "ours-bare-engine", "random", both[0]))
        h["serve_overhead_ttft_s_at_low_load"] = o["ttft_p50_s"] - b["ttft_p50_s"]
    # APC on / off for each prefix workload (`prefix`, `prefix-<length>`), through the
    # proxy (the app against `ours-no-apc`) and behind HAProxy (its two variants' rows).
    prefixes = {r["workload"].split(" (")[0] for r in rows if _plan_of(r["workload"]) == "prefix"}
    haproxy, haproxy_off = (f" ({VARIANTS[v].label})" for v in ("ours-haproxy", "ours-haproxy-no-apc"))
    for suffix, on_label, off_system, off_label in (("", "", "ours-no-apc", ""),
                                                    ("_haproxy", haproxy, "ours", haproxy_off)):
        by_len = {}
        for base in prefixes:
            on, off = pick(rows, "ours", base + on_label), pick(rows, off_system, base + off_label)
            if not (ok(on) and ok(off)):
                continue
            if base == "prefix":
                h[f"apc_ttft_p50_speedup{suffix}"] = off["ttft_p50_s"] / on["ttft_p50_s"]
                h[f"apc_ttft_mean_speedup{suffix}"] = off["ttft_mean_s"] / on["ttft_mean_s"]
            if on.get("prefix_len"):
                by_len[on["prefix_len"]] = off["ttft_p50_s"] / on["ttft_p50_s"]
        if len(by_len) > 1:
            h[f"apc_ttft_p50_speedup_by_prefix_len{suffix}"] = dict(sorted(by_len.items()))
    mem = [(pick(rows, "ours-bare-engine", "kv-memory", c), pick(rows, "mlx_lm.server", "kv-memory", c))
           for c in sorted({r["concurrency"] for r in rows if r["workload"] == "kv-memory"})]
    mem = [(a, b) for a, b in mem if a and b]
    if mem:
        h["kv_peak_ratio_dense_over_paged"] = {a["concurrency"]: b["kv_bytes_peak"] / max(a["kv_bytes_peak"], 1)
                                               for a, b in mem}
    return h


def sweep_points(rows: list[dict], system: str) -> tuple[list[tuple[int, float]], list[int]]:
    """A system's (concurrency, output tok/s) points of the sweep, and the loads where every
    request failed: those have no throughput to draw (not zero), only a note."""
    sweep = [r for r in rows if r["system"] == system and r["workload"] == "random"]
    return (sorted((r["concurrency"], r["output_tok_s"]) for r in sweep if r.get("completed") != 0),
            sorted(r["concurrency"] for r in sweep if r.get("completed") == 0))


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    systems = sorted({r["system"] for r in rows}, key=lambda s: (not s.startswith("ours"), s))
    for s in systems:
        pts, failed = sweep_points(rows, s)
        if pts:
            ax[0, 0].plot(*zip(*pts), marker="o",
                          label=s + (f" (all failed at {', '.join(map(str, failed))})" if failed else ""))
        g = sorted((r["concurrency"], r["output_tok_s"]) for r in rows
                   if r["system"] == s and r["workload"].startswith("random (attention"))
        if g:
            ax[0, 0].plot(*zip(*g), marker="x", linestyle="--", label=s + " (gather attention)")
    ax[0, 0].set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title="Throughput vs concurrency")
    for s in systems:
        r = pick(rows, s, "random-poisson")
        if r and r["ttfts_s"]:
            t = np.sort(r["ttfts_s"])
            ax[0, 1].plot(t, np.arange(1, len(t) + 1) / len(t), label=s)
    ax[0, 1].set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests",
                 title="TTFT CDF, Poisson at 80 % of mlx_lm.server's peak")
    for s, lab in (("ours-bare-engine", "paged (ours)"), ("mlx_lm.server", "dense (mlx-lm BatchGenerator)")):
        pts = sorted((r["concurrency"], r["kv_bytes_peak"] / 2**20) for r in rows
                     if r["system"] == s and r["workload"] == "kv-memory")
        if pts:
            ax[1, 0].plot(*zip(*pts), marker="o", label=lab)
    ax[1, 0].set(xscale="log", xlabel="concurrency", ylabel="peak KV MiB", title="KV memory vs concurrency")
    if not any(r["workload"] == "kv-memory" for r in rows):
        ax[1, 0].text(0.5, 0.5, "not measured in this run (--no-kv-memory)", ha="center", va="center",
                      transform=ax[1, 0].transAxes)
    bars = sorted((f"{r['system']}\n{r['workload']}", r["ttft_p50_s"]) for r in rows
                  if _plan_of(r["workload"]) in ("prefix", "multi-turn") and r["ttft_p50_s"] is not None)
    if bars:
        ax[1, 1].barh([b[0] for b in bars], [b[1] for b in bars])
        ax[1, 1].set(xscale="log", xlabel="TTFT p50 (s)", title="Prefix reuse: TTFT p50")
        ax[1, 1].tick_params(axis="y", labelsize=7)
    for a in ax.flat:
        a.xaxis.set_minor_formatter(NullFormatter())     # log-axis minor labels overlap
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(out: Path, rows: list[dict], meta: dict) -> None:
    """Write the rows, each with the meta of the run that measured it: rows merged from
    an earlier run keep theirs, and rows written before a run is cut short carry this one's."""
    for r in rows:
        r.setdefault("meta", meta)
    out.write_text(json.dumps(rows, indent=1))


def _portable(args: dict) -> dict:
    """The run's arguments without this machine's paths."""
    out = portable_args(args)
    if out.get("vllm_mlx"):
        out["vllm_mlx"] = Path(out["vllm_mlx"]).name
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default', 'llama-1b' (random, bf16) or a path")
    ap.add_argument("--tag", default="cpu", help="results go to compare_<tag>.json/png")
    ap.add_argument("--systems", nargs="+", default=["mlx_lm.server", "ours", "ours-bare-engine",
                                                     "ours-no-apc", "vllm-mlx", "ours-gather",
                                                     "ours-engine-thread"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--variant-concurrency", type=int, nargs="+", default=None,
                    help="the sweep of the app's variants (ours-gather, ...); default: --concurrency")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="our engine's max_num_seqs (default: the largest --concurrency)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--prompts-per-stream", type=int, default=2)
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--poisson-prompts", type=int, default=96)
    ap.add_argument("--poisson-rate", type=float, default=None, help="default: 80 %% of mlx_lm.server's peak")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="the `random-poisson` arrivals' gamma shape, as serve_bench's (1: Poisson)")
    ap.add_argument("--prefix-len", type=int, nargs="+", default=[1024],
                    help="one prefix workload per length: `prefix`, then `prefix-<length>` rows")
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--prefix-output-len", type=int, default=16)
    ap.add_argument("--prefix-prompts", type=int, default=48)
    ap.add_argument("--prefix-concurrency", type=int, default=4)
    ap.add_argument("--num-sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-len", type=int, default=64)
    ap.add_argument("--turn-output-len", type=int, default=32)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--vllm-mlx", default=None, help="path of a vllm-mlx executable (its own venv)")
    ap.add_argument("--no-kv-memory", action="store_true")
    ap.add_argument("--merge", action="store_true", help="add to the existing JSON instead of replacing it")
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--workloads", nargs="+", default=["random", "poisson", "prefix", "multi-turn"],
                    help="which workloads to run (with --merge, only their rows are replaced)")
    ap.add_argument("--replot", action="store_true", help="only redo the headline and plot from the JSON")
    args = ap.parse_args(argv)
    if not args.burstiness > 0:
        ap.error(f"--burstiness must be > 0, got {args.burstiness}")
    unknown = [s for s in args.systems if s not in SYSTEMS and app_variant(s) is None]
    if unknown:
        ap.error(f"unknown systems {unknown}: {', '.join(SYSTEMS)}, ours-chunks-N, ours-tokenize-threads-N or {', '.join(VARIANTS)}")
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.replot:
        rows = json.loads((Path(args.results_dir) / f"compare_{args.tag}.json").read_text())
        h = headline(rows, args)
        print(json.dumps(h, indent=2))
        head = Path(args.results_dir) / f"compare_{args.tag}_headline.json"
        meta = json.loads(head.read_text())["meta"] if head.exists() else rows[0]["meta"]
        head.write_text(json.dumps({"headline": h, "meta": meta}, indent=2))
        plot(rows, Path(args.results_dir) / f"compare_{args.tag}.png", f"{rows[0]['meta']['model']} on "
             f"{rows[0]['meta']['device']}")
        return

    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    model = resolve_model(args.model)
    tok = load_tokenizer(Path(model))
    extra = sb.eos_logit_bias(tok)
    wl = Workloads(tok, args)
    top = max(args.concurrency)
    engine = {"max_num_seqs": args.max_num_seqs or top, "max_num_batched_tokens": args.max_num_batched_tokens,
              "kv_cache_memory_bytes": int(args.kv_cache_gb * 2**30)}
    cuda = mx.default_device() == mx.gpu and not mx.metal.is_available()
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"compare_{args.tag}.json"
    rows = json.loads(out.read_text()) if args.merge and out.exists() else []
    only = set(args.workloads)
    rows = [r for r in rows if not (r.get("source") in args.systems and _plan_of(r["workload"]) in only)]
    skipped = {}
    vllm_exe, why = find_vllm_mlx(args.vllm_mlx)

    rate = args.poisson_rate
    if rate is None and mlx_lm_sweep(rows):
        rate = poisson_rate(rows, args.output_len)[0]
    host = {}
    meta = {**run_meta(args), "args": _portable(vars(args)), "skipped": skipped,
            "poisson_rate_req_s": rate, "host": host}

    def keep(row: dict) -> None:
        """Each point is written as soon as it is measured: a run cut short (a time
        limit's SIGTERM) keeps every point it finished."""
        rows.append({**row, "source": name})
        save(out, rows, meta)

    for name in args.systems:
        t0 = time.perf_counter()
        n_before = len(rows)
        ticks0, speed0 = cpu_ticks(), host_speed()
        if name == "mlx_lm.server":
            # The sweep, the first prefix length with multi-turn, each further prefix
            # length, and Poisson arrivals each get a fresh server: after a burst of
            # hundreds of streams, or waves of 7,680-token prompts, mlx_lm.server can stop
            # generating (its generation thread dies and every later request fails),
            # which would lose the rest.
            with mlx_lm_server(model, top, extra) as t:
                run_system(t, wl, args, {"random"}, None, keep)
            if not rate and mlx_lm_sweep(rows):
                rate = poisson_rate(rows, args.output_len)[0]
            if {"prefix", "multi-turn"} & set(args.workloads):
                with mlx_lm_server(model, top, extra) as t:
                    run_system(t, wl, args, {"prefix", "multi-turn"}, None, keep, lengths=range(1))
            for i in range(1, len(args.prefix_len)) if "prefix" in args.workloads else ():
                with mlx_lm_server(model, top, extra) as t:
                    run_system(t, wl, args, {"prefix"}, None, keep, lengths=range(i, i + 1))
            if rate and "poisson" in args.workloads:
                with mlx_lm_server(model, top, extra) as t:
                    run_system(t, wl, args, {"poisson"}, rate, keep)
        elif name == "ours":
            with ours(model, engine, "ours", extra) as t:
                run_system(t, wl, args, {"random", "poisson", "prefix", "multi-turn"}, rate, keep)
        elif name == "ours-bare-engine":
            with bare_engine(model, engine, extra) as t:
                run_system(t, wl, args, {"random", "poisson", "prefix", "multi-turn"}, rate, keep)
        elif name == "ours-no-apc":
            with ours(model, {**engine, "enable_prefix_caching": False}, "ours-no-apc", extra) as t:
                run_system(t, wl, args, {"prefix", "multi-turn"}, rate, keep)
        elif name == "vllm-mlx":
            if vllm_exe is None:
                skipped[name] = why
                continue
            with vllm_mlx_server(vllm_exe, model, top, extra) as t:
                run_system(t, wl, args, {"random", "poisson", "prefix", "multi-turn"}, rate, keep)
        elif (v := app_variant(name)) is not None:
            if name == "ours-gather" and not cuda:
                skipped[name] = "no attention kernel on this device: 'auto' already runs gather here"
                continue
            with v.app(model, engine, "ours", extra) as t:
                run_system(t, wl, args, set(v.workloads), rate, keep, v.label, **v.setting)
        meta["poisson_rate_req_s"] = rate
        save(out, rows, meta)
        if len(rows) > n_before:
            host[name] = host_during(ticks0, speed0)
        probe = host.get(name, {})
        print(f"-- {name}: {time.perf_counter() - t0:.0f} s; host yardstick {speed0:.1f} -> "
              f"{probe.get('gflops_after', float('nan')):.1f} GFLOP/s, steal {probe.get('steal_frac', 0):.1%}",
              flush=True)
    if not args.no_kv_memory:
        rows = [r for r in rows if r["workload"] != "kv-memory"]
        rows += [{**r, "source": "kv-memory"} for r in kv_memory_rows(model, engine, args)]

    h = headline(rows, args)
    print("\nheadline:", json.dumps(h, indent=2))
    for k, v in skipped.items():
        print(f"skipped {k}: {v}")
    save(out, rows, meta)
    (results / f"compare_{args.tag}_headline.json").write_text(json.dumps({"headline": h, "meta": meta}, indent=2))
    try:
        plot(rows, results / f"compare_{args.tag}.png", f"{args.model} on {meta['device']} ({platform.machine()})")
    except ImportError:
        print("matplotlib is not installed: no plot (python bench/compare.py --replot TAG makes it later)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
