"""A simulated Mac cluster on this machine: aggregate throughput of 1 vs 2 replicas, and
prefix-aware routing vs Ray's default router on a multi-prefix workload.

`ray.cluster_utils.Cluster` runs a head node and three nodes, one per simulated Mac
(custom resource `mac`), all on 127.0.0.1. Each `LLMServer` replica needs one `mac`,
so replicas land one per node. Routing is compared with 2 and with 3 replicas. Beside
the served runs, bare engines pinned one per CPU show what the cores themselves scale to.
Writes `bench/results/cluster.json` and `cluster.png` (`--replot` redraws the PNG
from the JSON). `--direct-ingress` runs the same under Ray Serve's direct ingress (each
app's ingress replica answers HTTP on a port of its own, no proxy between) and writes
`cluster_direct_ingress.json` / `.png`; `--haproxy` under its HAProxy mode (HAProxy on
the head node's HTTP port, in front of the ingress replicas' own ports) and writes
`cluster_haproxy.json` / `.png`. `--parts throughput` or `--parts routing` runs
one half alone; `--device cpu` puts every engine on MLX's CPU backend, to measure
replicas on the cores of a GPU host.

    python bench/cluster_bench.py [--direct-ingress | --haproxy] [--parts throughput routing] [--device cpu]
"""

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from bench import serve_bench as sb  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "default"
ROUTER = {"request_router_class": "deployments.router:PrefixAwareRouter",
          "request_router_kwargs": {"imbalance_threshold": 8},
          "request_routing_stats_period_s": 1, "request_routing_stats_timeout_s": 5}


DIRECT_INGRESS_PORTS = 64   # ports in the range the apps' ingress replicas bind in


def start_cluster(num_macs: int, front: str = "proxy"):
    """A head node plus `num_macs` nodes with a `mac` resource; Serve on 127.0.0.1 with
    one HTTP proxy, on the head node, as `configs/cluster.yaml` runs it (a proxy on every
    node would put four on this host's cores, three of them idle). `front`, as in
    `tests.serving.ServeRun`: "direct" turns on Ray Serve's direct ingress for the
    cluster's processes (`app_url` finds each app's port), "haproxy" its HAProxy mode
    (HAProxy on the proxy's port)."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from tests.serving import direct_ingress_env, free_port, haproxy_env

    if front != "proxy":   # set before the nodes start, which read it
        base = free_port()
        os.environ.update(direct_ingress_env(base, base + DIRECT_INGRESS_PORTS))
    if front == "haproxy":
        os.environ.update(haproxy_env(tempfile.mkdtemp(prefix="mps-haproxy-")))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(num_macs):
        cluster.add_node(num_cpus=2, resources={"mac": 2})
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    return cluster, f"http://127.0.0.1:{port}"


def stop_cluster(cluster) -> None:
    import ray
    from ray import serve

    from tests.serving import live_pids

    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
    state = os.environ.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE")
    if state:   # an HAProxy that Serve restarted while shutting down can outlive it
        for pid in live_pids("-f", f"haproxy.*{state}"):
            os.kill(pid, signal.SIGTERM)


def deploy(name: str, route: str, replicas: int, router: dict | None, kv_blocks: int = 48,
           autoscaling: dict | None = None, pin_cpus: int | None = None, device: str | None = None):
    from ray import serve

    from deployments.app import AppArgs, build_app

    llm = {"num_replicas": replicas, "max_replicas_per_node": 1, "max_ongoing_requests": 64,
           "ray_actor_options": {"num_cpus": 0.5, "resources": {"mac": 1}}}
    if router:
        llm["request_router_config"] = router
    if autoscaling:
        llm["autoscaling_config"] = autoscaling
    args = AppArgs(served_model_name=MODEL, llm_server=llm,
                   engine={"num_gpu_blocks": kv_blocks, "block_size": 16, "max_num_seqs": 32, "device": device},
                   ingress={"ray_actor_options": {"num_cpus": 0.1}}, pin_cpus=pin_cpus)
    serve.run(build_app(args), name=name, route_prefix=route)


def app_url(url: str, route: str, timeout: float = 60.0) -> str:
    """Where an app deployed at `route` answers: through the proxy at `url`, or under
    direct ingress on its ingress replica's own port (the first in the range whose
    `route` answers /health; deploy one app at a time there)."""
    if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1" or os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        return url + route
    low = int(os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for port in range(low, low + DIRECT_INGRESS_PORTS):
            try:
                if httpx.get(f"http://127.0.0.1:{port}{route}/health", timeout=1).status_code == 200:
                    return f"http://127.0.0.1:{port}{route}"
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise TimeoutError(f"no direct-ingress port answers {route}")


def replica_metrics(url: str) -> dict[str, dict[str, float]]:
    """Per-replica counters from `/metrics`: {replica: {metric: value}}."""
    out: dict[str, dict[str, float]] = {}
    text = httpx.get(url + "/metrics", timeout=30).text
    for m in re.finditer(r'^mlx_paged_serve:replica_(\w+?)(?:_total)?\{[^}]*replica="([^"]+)"[^}]*\} ([0-9.e+-]+)$',
                         text, re.M):
        out.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
    return out


BARE = """
import os, random, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
from bench.bench_continuous_vs_static import run_ours
from runtime import EngineConfig, LLMEngine
eng = LLMEngine(EngineConfig(num_gpu_blocks=512, max_num_seqs=32, device=sys.argv[2] if len(sys.argv) > 2 else None))
rng = random.Random(1)
reqs = [([rng.randrange(3, 500) for _ in range(64)], 64) for _ in range(32 + 96)]
run_ours(eng, reqs[:32], 32, "warm")
print(run_ours(eng, reqs[32:], 32, "bare")["output_tok_s"])
"""


def bare_engines(cpus: list[int], device: str | None = None) -> float:
    """Aggregate tok/s of bare `LLMEngine`s (no Ray, no HTTP), one per CPU in `cpus`,
    each pinned there and running 32 sequences: what the cores give without serving.
    Every prompt is new to the engine (none is in its prefix cache), as the served
    load's are."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", BARE, str(c)] + ([device] if device else []),
                              stdout=subprocess.PIPE, text=True, env=env)
             for c in cpus]
    return sum(float(p.communicate()[0].split()[-1]) for p in procs)


def mixed_load(n: int, seed: int = 5) -> tuple[list[list[int]], list[int]]:
    """`n` prompts of 32-96 tokens with 32-96 tokens to generate (mean 64 each). Lengths
    vary as a live service's do: with one fixed length, requests that start together end
    together, and each replica idles while the next wave crosses HTTP and Ray."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(32, 96))] for _ in range(n)]
    return prompts, [rng.randint(32, 96) for _ in range(n)]


def families(n_families: int, prefix_blocks: int, per_family: int, seed: int = 0) -> list[list[int]]:
    """Prompts sharing one of `n_families` prefixes of `prefix_blocks` full blocks, each
    with its own 8-token tail, in a random order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(16 * prefix_blocks)] for _ in range(n_families)]
    prompts = [prefixes[f] + [rng.randrange(3, 500) for _ in range(8)]
               for _ in range(per_family) for f in range(n_families)]
    rng.shuffle(prompts)
    return prompts


async def _run(url: str, prompts: list, concurrency: int, max_tokens: int | list[int],
               stream: bool = True) -> dict:
    """Send `prompts` with at most `concurrency` in flight; `max_tokens` is one length for
    all or one per prompt. Unstreamed, a request costs one response instead of a message
    per chunk, and TTFT is not measured."""
    backend = sb.HTTPBackend(url, MODEL, {"ignore_eos": True}, stream=stream)
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    try:
        s = await sb.run(backend, [sb.Request(p, None, n) for p, n in zip(prompts, lengths)],
                         max_concurrency=concurrency, progress=False, sampler=engines_load(url))
    finally:
        await backend.aclose()
    assert not s["failed"], s["errors"]
    ttft = s["ttft_s"] if stream else {"p50": None, "p95": None}
    # the first and last samples catch the run filling up and draining
    load = [x for x in s["samples"][1:-1] or s["samples"] if x is not None]
    return {"wall_s": s["duration_s"], "output_tokens": s["total_output_tokens"],
            "output_tok_s": s["output_throughput"], "ttft_p50_s": ttft["p50"], "ttft_p95_s": ttft["p95"],
            "requests_in_engines_mean": float(np.mean(load)) if load else None}


def engines_load(url: str):
    """A `serve_bench.run` sampler: the requests the replicas' engines hold (running plus
    waiting, all replicas) from `/metrics`; against the requests the client keeps in
    flight, the rest are in transit through HTTP and Ray. None when `/metrics` fails."""
    from tests.serving import metric

    def sample() -> float | None:
        try:
            text = httpx.get(url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return None
        return (metric(text, "num_requests_running") or 0) + (metric(text, "num_requests_waiting") or 0)
    return sample


# Who uses the host's CPUs, by command line: the engines, Serve's actors by role, Ray's
# own daemons and workers, and this process (the client). First match wins.
CPU_KINDS = (("engines", ("runtime.engine_process",)), ("replica fronts", (":LLMServer",)),
             ("ingress", (":OpenAIIngress",)), ("proxy", ("ProxyActor", "bin/haproxy")),
             ("controller", ("ServeController",)), ("ray daemons", ("ray/", "ray::")))


def cpu_seconds() -> dict[int, tuple[str, float]] | None:
    """{pid: (kind, CPU seconds used so far)} for the processes of `CPU_KINDS` and this
    one (the client), from /proc; None where there is none (macOS)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue   # it exited meanwhile
        pid = int(d.name)
        kind = "client" if pid == os.getpid() else next(
            (k for k, pats in CPU_KINDS if any(p in cmd for p in pats)), None)
        if kind:
            out[pid] = (kind, (int(fields[11]) + int(fields[12])) / tick)   # utime + stime
    return out


def cores_used(before: dict | None, after: dict | None, wall_s: float) -> dict[str, float] | None:
    """Mean CPUs each kind kept busy between two `cpu_seconds()` snapshots, process by
    process: one started meanwhile counts whole, one that exited meanwhile is missed (a
    kind can read low, never high)."""
    if before is None or after is None:
        return None
    used = {k: 0.0 for k, _ in CPU_KINDS} | {"client": 0.0}
    for pid, (kind, secs) in after.items():
        was = before.get(pid)
        used[kind] += secs - (was[1] if was and was[0] == kind else 0.0)
    used = {k: v / wall_s for k, v in used.items()}
    return {**used, "total": sum(used.values())}


def run_workload(url: str, prompts: list, concurrency: int = 4, max_tokens: int | list[int] = 8,
                 stream: bool = True) -> dict:
    before = replica_metrics(url)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    res = asyncio.run(_run(url, prompts, concurrency, max_tokens, stream))
    res["cpu_cores"] = cores_used(cpu0, cpu_seconds(), time.perf_counter() - t0)
    time.sleep(1.5)
    after = replica_metrics(url)
    q = h = 0.0
    per_replica = {}
    for rep, m in after.items():
        b = before.get(rep, {})
        dq = m.get("prefix_cache_query_tokens", 0) - b.get("prefix_cache_query_tokens", 0)
        dh = m.get("prefix_cache_hit_tokens", 0) - b.get("prefix_cache_hit_tokens", 0)
        per_replica[rep] = m.get("requests_finished", 0) - b.get("requests_finished", 0)
        q, h = q + dq, h + dh
    res.update(hit_rate=h / q if q else 0.0, hit_tokens=h, query_tokens=q, requests_per_replica=per_replica)
    return res


def combine(runs: list[dict]) -> dict:
    """Runs of one setup as one: hit rate over all their prompt tokens, TTFT medians of
    the runs' percentiles, each run's own figures under `runs`."""
    h, q = sum(r["hit_tokens"] for r in runs), sum(r["query_tokens"] for r in runs)
    return {"hit_rate": h / q if q else 0.0, "hit_tokens": h, "query_tokens": q,
            "ttft_p50_s": float(np.median([r["ttft_p50_s"] for r in runs])),
            "ttft_p95_s": float(np.median([r["ttft_p95_s"] for r in runs])),
            "hit_rate_per_run": [r["hit_rate"] for r in runs], "runs": runs}


def plot(result: dict, path: Path) -> Path:
    """Three panels: aggregate throughput (1 vs 2 replicas, streamed and not), prefix-cache
    hit rate and TTFT p50/p95 (prefix-aware vs default router)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = result.get("cpu_cores")
    fig, ax = plt.subplots(1, 4 if cpu else 3, figsize=(17 if cpu else 13, 3.8))
    runs = [("streamed", result)]
    if "unstreamed" in result:
        runs.append(("unstreamed", result["unstreamed"]))
    if "bare_engines" in result:
        b = result["bare_engines"]
        runs.append(("bare engines", {"replicas_1_output_tok_s": b["one_cpu_tok_s"],
                                      "replicas_2_output_tok_s": b["two_cpus_tok_s"],
                                      "throughput_ratio_2_vs_1": b["ratio"]}))
    x = np.arange(len(runs))
    for i, (key, color) in enumerate((("replicas_1_output_tok_s", "tab:gray"), ("replicas_2_output_tok_s", "tab:blue"))):
        ax[0].bar(x + (i - 0.5) * 0.38, [r[key] for _, r in runs], 0.38, color=color,
                  label=("1 replica", "2 replicas")[i])
    ax[0].set_xticks(x, [f"{name}\n({r['throughput_ratio_2_vs_1']:.2f}x)" for name, r in runs], fontsize=8)
    ax[0].set_ylabel("output tok/s")
    ax[0].set_title("throughput, 1 vs 2 replicas")
    ax[0].legend(fontsize=8)
    routers = ["prefix-aware", "default"]
    groups = [("2 replicas", result)]
    if "routing_3_replicas" in result:
        groups.append(("3 replicas", result["routing_3_replicas"]))
    x = np.arange(len(groups))
    for i, (key, color) in enumerate((("prefix_router_hit_rate", "tab:green"), ("default_router_hit_rate", "tab:gray"))):
        ax[1].bar(x + (i - 0.5) * 0.38, [100 * g[key] for _, g in groups], 0.38, color=color, label=routers[i])
    ax[1].set_xticks(x, [name for name, _ in groups])
    ax[1].set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax[1].set_title("routing: cache hits")
    ax[1].legend(fontsize=8)
    x = np.arange(2)
    for i, (q, label) in enumerate((("p50", "TTFT p50"), ("p95", "TTFT p95"))):
        ax[2].bar(x + (i - 0.5) * 0.38, [result[f"prefix_router_ttft_{q}_s"], result[f"default_router_ttft_{q}_s"]],
                  0.38, label=label)
    ax[2].set_xticks(x, routers)
    ax[2].set_ylabel("seconds")
    ax[2].set_title("routing: TTFT")
    ax[2].legend(fontsize=8)
    if cpu:
        runs = [(label, cpu[key]) for label, key in (("1 replica\nstreamed", "replicas_1"),
                                                      ("2 replicas\nstreamed", "replicas_2"),
                                                      ("1 replica\nunstreamed", "replicas_1_unstreamed"),
                                                      ("2 replicas\nunstreamed", "replicas_2_unstreamed"))
                if cpu.get(key)]
        bottom = np.zeros(len(runs))
        for kind, _ in CPU_KINDS + (("client", None),):
            vals = np.array([c[kind] for _, c in runs])
            ax[3].bar(range(len(runs)), vals, 0.6, bottom=bottom, label=kind)
            bottom += vals
        ax[3].axhline(result.get("num_cpus") or 0, color="k", lw=0.8, ls="--")
        ax[3].set_xticks(range(len(runs)), [label for label, _ in runs], fontsize=8)
        ax[3].set_ylabel("CPUs busy (mean)")
        ax[3].set_title("where the CPUs go (throughput runs)")
        ax[3].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    how = ", HAProxy" if result.get("haproxy") else ", direct ingress" if result.get("direct_ingress") else ""
    fig.suptitle(f"simulated Mac cluster on one {result.get('num_cpus', '?')}-CPU host{how} (bench/cluster_bench.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def measure_throughput(app, device: str | None) -> dict:
    """1 vs 2 replicas, each engine pinned to its own CPU, streamed and unstreamed."""
    # 64 in flight: enough to fill both replicas' 32 sequences, so each setup runs at
    # its capacity (with fewer, two replicas would each run half-empty batches).
    # Unstreamed, a request costs two Ray messages instead of one per chunk, which shows
    # how much of the CPU the streaming path takes from the engines.
    load, lengths = mixed_load(32 + 256)
    tput = {}
    for name, replicas in (("one", 1), ("two", 2)):
        # Each replica's engine on its own CPU (rank 0 -> CPU 0, rank 1 -> CPU 1), as a
        # replica owns its Mac: 1 replica gets one core of MLX work, 2 replicas two.
        with app(name, replicas, None, kv_blocks=256, pin_cpus=1, device=device) as u:
            run_workload(u, load[:32], 16, 16)
            tput[name] = run_workload(u, load[32:], concurrency=64, max_tokens=lengths[32:])
            tput[name + "_unstreamed"] = run_workload(u, load[32:], concurrency=64, max_tokens=lengths[32:],
                                                      stream=False)
    return tput


def measure_routing(app, args) -> dict:
    """Prefix-aware vs Ray's default router, with 2 and with 3 replicas."""
    # Each family set (new prefixes per seed) runs once per router; hit rates add up
    # over the sets, since one set's figure for Ray's router swings with chance. With 3
    # replicas, routing by chance scatters each family over more caches.
    sets = [families(args.families, prefix_blocks=5, per_family=args.per_family, seed=k)
            for k in range(args.repeats)]
    routed = {}
    for name, replicas, router in (("prefix", 2, ROUTER), ("default", 2, None),
                                   ("prefix3", 3, ROUTER), ("default3", 3, None)):
        with app(name, replicas, router, kv_blocks=44, device=args.device) as u:
            routed[name] = combine([run_workload(u, p) for p in sets])
    return routed


def throughput_fields(bare: dict, t: dict) -> dict:
    one, two, one_ns, two_ns = t["one"], t["two"], t["one_unstreamed"], t["two_unstreamed"]
    return {
        "replicas_1_output_tok_s": one["output_tok_s"], "replicas_2_output_tok_s": two["output_tok_s"],
        "throughput_ratio_2_vs_1": two["output_tok_s"] / one["output_tok_s"],
        "bare_engines": {"one_cpu_tok_s": bare["one"], "two_cpus_tok_s": bare["two"],
                         "ratio": bare["two"] / bare["one"],
                         "what": "LLMEngine alone, no Ray or HTTP, 96 distinct 64-token prompts with 64 "
                                 "tokens out each, 32 at a time, one process pinned per CPU, run at once: "
                                 "what the cores scale to"},
        "requests_in_engines_mean": {
            "what": "requests the engines held (running + waiting, all replicas), sampled from /metrics "
                    "every 0.5 s during the throughput runs, of the 64 the client kept in flight; "
                    "the rest were in transit through HTTP and Ray",
            "replicas_1": one["requests_in_engines_mean"], "replicas_2": two["requests_in_engines_mean"],
            "replicas_1_unstreamed": one_ns["requests_in_engines_mean"],
            "replicas_2_unstreamed": two_ns["requests_in_engines_mean"]},
        "cpu_cores": {
            "what": "CPUs each kind of process kept busy on average during the throughput runs "
                    f"(of {os.cpu_count()}; from /proc): the engine processes, Serve's actors, Ray's "
                    "daemons and workers, and the benchmark client",
            "replicas_1": one["cpu_cores"], "replicas_2": two["cpu_cores"],
            "replicas_1_unstreamed": one_ns["cpu_cores"], "replicas_2_unstreamed": two_ns["cpu_cores"]},
        "unstreamed": {"replicas_1_output_tok_s": one_ns["output_tok_s"],
                       "replicas_2_output_tok_s": two_ns["output_tok_s"],
                       "throughput_ratio_2_vs_1": two_ns["output_tok_s"] / one_ns["output_tok_s"]},
    }


def routing_fields(r: dict) -> dict:
    pre, dflt, pre3, dflt3 = r["prefix"], r["default"], r["prefix3"], r["default3"]
    return {
        "prefix_router_hit_rate": pre["hit_rate"], "default_router_hit_rate": dflt["hit_rate"],
        "prefix_router_ttft_p50_s": pre["ttft_p50_s"], "default_router_ttft_p50_s": dflt["ttft_p50_s"],
        "prefix_router_ttft_p95_s": pre["ttft_p95_s"], "default_router_ttft_p95_s": dflt["ttft_p95_s"],
        "routing_3_replicas": {
            "prefix_router_hit_rate": pre3["hit_rate"], "default_router_hit_rate": dflt3["hit_rate"],
            "prefix_router_ttft_p50_s": pre3["ttft_p50_s"], "default_router_ttft_p50_s": dflt3["ttft_p50_s"]},
    }


def report(result: dict) -> None:
    d = result["details"]
    if "one" in d:
        bare, c = result["bare_engines"], result["cpu_cores"]
        print(f"bare engines: 1 CPU {bare['one_cpu_tok_s']:.0f} tok/s, 2 CPUs {bare['two_cpus_tok_s']:.0f} "
              f"tok/s ({bare['ratio']:.2f}x)")
        print(f"1 replica {d['one']['output_tok_s']:.0f} tok/s, 2 replicas {d['two']['output_tok_s']:.0f} tok/s "
              f"({result['throughput_ratio_2_vs_1']:.2f}x); unstreamed {d['one_unstreamed']['output_tok_s']:.0f} vs "
              f"{d['two_unstreamed']['output_tok_s']:.0f} tok/s ({result['unstreamed']['throughput_ratio_2_vs_1']:.2f}x)")
        m = result["requests_in_engines_mean"]
        print(f"requests in the engines (mean, of 64 in flight): 1 replica {m['replicas_1']:.1f}, "
              f"2 replicas {m['replicas_2']:.1f}; unstreamed {m['replicas_1_unstreamed']:.1f}, "
              f"{m['replicas_2_unstreamed']:.1f}")
        for key, name in (("replicas_1", "1 replica"), ("replicas_2", "2 replicas"),
                          ("replicas_1_unstreamed", "1 replica, unstreamed"),
                          ("replicas_2_unstreamed", "2 replicas, unstreamed")):
            if c[key]:
                print(f"CPUs busy, {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in c[key].items()))
    if "prefix" in d:
        r3 = result["routing_3_replicas"]
        print(f"hit rate: prefix router {result['prefix_router_hit_rate']:.1%}, default router "
              f"{result['default_router_hit_rate']:.1%}; TTFT p50 {result['prefix_router_ttft_p50_s']:.3f}s "
              f"vs {result['default_router_ttft_p50_s']:.3f}s")
        print(f"3 replicas: prefix router {r3['prefix_router_hit_rate']:.1%}, default router "
              f"{r3['default_router_hit_rate']:.1%}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", type=int, default=16)
    ap.add_argument("--per-family", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=6, help="family sets per routing comparison")
    ap.add_argument("--direct-ingress", action="store_true",
                    help="Ray Serve's direct ingress (no proxy hop); default --out cluster_direct_ingress.json")
    ap.add_argument("--haproxy", action="store_true",
                    help="Ray Serve's HAProxy mode (HAProxy in place of Serve's proxy); default --out "
                         "cluster_haproxy.json")
    ap.add_argument("--device", choices=("cpu", "gpu"), default=None,
                    help="MLX device of every engine (default: MLX's); `cpu` on a GPU host measures "
                         "replicas on its cores")
    ap.add_argument("--parts", nargs="+", choices=("throughput", "routing"), default=["throughput", "routing"],
                    help="what to measure (the JSON holds the fields of those measured)")
    ap.add_argument("--out", default=None, help="default: bench/results/cluster.json")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from --out")
    args = ap.parse_args(argv)
    if args.direct_ingress and args.haproxy:
        ap.error("--direct-ingress or --haproxy, not both")
    front = "haproxy" if args.haproxy else "direct" if args.direct_ingress else "proxy"
    args.out = args.out or str(RESULTS / {"proxy": "cluster.json", "direct": "cluster_direct_ingress.json",
                                          "haproxy": "cluster_haproxy.json"}[front])
    if args.replot:
        saved = json.loads(Path(args.out).read_text())
        if len(saved.get("parts", ["throughput", "routing"])) < 2:
            ap.error(f"{args.out} holds only {saved['parts']}: the PNG needs both parts")
        print("wrote", plot(saved, Path(args.out).with_suffix(".png")))
        return
    if "throughput" in args.parts:
        bare = {"one": bare_engines([0], args.device), "two": bare_engines([0, 1], args.device)}
    cluster, url = start_cluster(num_macs=3, front=front)

    @contextmanager
    def app(name: str, *deploy_args, **deploy_kwargs):
        """One app at a time: deployed, its URL, then deleted (which frees its Macs)."""
        from ray import serve

        deploy(name, "/" + name, *deploy_args, **deploy_kwargs)
        try:
            yield app_url(url, "/" + name)
        finally:
            serve.delete(name)

    result, details = {}, {}
    try:
        if "throughput" in args.parts:
            t = measure_throughput(app, args.device)
            result.update(throughput_fields(bare, t))
            details.update(t)
        if "routing" in args.parts:
            r = measure_routing(app, args)
            result.update(routing_fields(r))
            details.update(r)
    finally:
        stop_cluster(cluster)
    result.update({
        "details": details,
        "note": ("simulated nodes share this machine's cores; for 1 vs 2 replicas each replica's "
                 "engine process (MLX's threads with it) is pinned to its own CPU (pin_cpus=1); Ray's "
                 "own processes and threads and the client are not pinned. Throughput: 256 requests "
                 "of 32-96 prompt and 32-96 output tokens, 64 in flight. Routing: "
                 f"{args.repeats} sets of {args.families} prefix families x {args.per_family} requests, "
                 "5-block prefixes, 44 KV blocks per replica"),
        "num_cpus": os.cpu_count(),
        "direct_ingress": args.direct_ingress,
        "haproxy": args.haproxy,
        "device": args.device or "default",
        "parts": args.parts,
    })
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    try:
        if len(args.parts) == 2:
            plot(result, Path(args.out).with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot (--replot makes it later)")
    report(result)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
