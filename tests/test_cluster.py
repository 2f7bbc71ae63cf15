"""A simulated Mac cluster: replicas on separate nodes, prefix-aware routing, a replica
lost mid-run, and autoscaling."""

import os
import signal
import time

import httpx
import openai
import pytest
import yaml

from bench.cluster_bench import ROUTER, deploy, families, run_workload, start_cluster, stop_cluster

from .serving import ROOT, engine_pids, replica_pids

MODEL = "default"


@pytest.fixture(scope="module")
def cluster():
    c, url = start_cluster(num_macs=2)
    yield url
    stop_cluster(c)


def test_prefix_aware_routing_beats_default(cluster):
    # 44 blocks per replica cannot hold all 16 families' 5-block prefixes (80 blocks), so a
    # router that sends every family everywhere makes each replica's LRU cache thrash;
    # half the families per replica (40 blocks) fit.
    deploy("prefix", "/prefix", 2, ROUTER, kv_blocks=44, pin_cpus=1)
    deploy("default", "/default", 2, None, kv_blocks=44)
    if hasattr(os, "sched_getaffinity") and (os.cpu_count() or 1) >= 2:
        # pin_cpus=1: replica rank r runs its engine process (MLX's threads with it) on
        # CPU r alone; the replica's own (Ray's) threads stay free.
        pinned, free = [], set()
        for pid in replica_pids("prefix"):
            free |= {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f"/proc/{pid}/task")}
            for e in engine_pids(pid):
                pinned.append({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f"/proc/{e}/task")})
        assert sorted(sorted(m) for m in pinned) == [[(0,)], [(1,)]] and all(len(m) > 1 for m in free)
    prompts = families(16, prefix_blocks=5, per_family=4)
    pre = run_workload(cluster + "/prefix", prompts)
    dflt = run_workload(cluster + "/default", prompts)
    print(f"hit rate: prefix-aware {pre['hit_rate']:.1%} {pre['requests_per_replica']}, "
          f"default {dflt['hit_rate']:.1%} {dflt['requests_per_replica']}")
    assert len([n for n in pre["requests_per_replica"].values() if n > 0]) == 2, "both replicas serve"
    # Every family's first request misses and its tail block never matches: the most any
    # router can reach is 3/4 x 80/88 = 68 %. Ray's default router scatters families.
    assert pre["hit_rate"] >= 0.6
    assert pre["hit_rate"] >= 1.3 * dflt["hit_rate"]


def test_lost_replica_stops_receiving_traffic(cluster):
    url = cluster + "/prefix"
    pids = replica_pids("prefix")
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    time.sleep(1.0)
    prompts = families(4, prefix_blocks=2, per_family=3, seed=9)
    t = time.monotonic()
    done, failed = 0, 0
    for p in prompts:   # every client gets an answer or an error, quickly: none hangs
        try:
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 4},
                           timeout=60)
            done += r.status_code == 200
            failed += r.status_code != 200
        except httpx.HTTPError:
            failed += 1
    print(f"after losing a replica: {done} answered, {failed} errors in {time.monotonic() - t:.1f}s")
    assert done >= len(prompts) - 2


def test_autoscaling_up_and_down(cluster):
    from ray import serve

    for name in ("prefix", "default"):      # free the simulated Macs
        serve.delete(name)
    deploy("auto", "/auto", 1, ROUTER, autoscaling={
        "min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "target_ongoing_requests": 2,
        "upscale_delay_s": 1, "downscale_delay_s": 4, "metrics_interval_s": 0.5,
        "look_back_period_s": 2})

    def running() -> int:
        d = serve.status().applications["auto"].deployments["LLMServer"]
        return d.replica_states.get("RUNNING", 0)

    import asyncio

    async def load(seconds: float):
        async with httpx.AsyncClient() as cl:
            end = time.monotonic() + seconds

            async def worker(i):
                while time.monotonic() < end:
                    await cl.post(cluster + "/auto/v1/completions", timeout=60, json={
                        "model": MODEL, "prompt": f"load {i}", "max_tokens": 64, "ignore_eos": True})

            await asyncio.gather(*(worker(i) for i in range(10)))

    peak = 1
    for _ in range(6):
        asyncio.run(load(5))
        peak = max(peak, running())
        if peak == 2:
            break
    deadline = time.monotonic() + 90
    while running() > 1 and time.monotonic() < deadline:
        time.sleep(2)
    print(f"autoscaling: peak {peak} replicas, {running()} after the load")
    assert peak == 2 and running() == 1


def _alive_actor_nodes(list_actors, class_name: str, timeout_s: float = 60) -> set[str]:
    """The nodes of a class's live actors, through Ray's state API, which reads the
    dashboard: on a loaded machine the dashboard can come up after Serve's replicas, so
    its errors are retried for a while."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return {a.node_id for a in list_actors(filters=[("class_name", "=", class_name),
                                                            ("state", "=", "ALIVE")])}
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def test_shipped_cluster_config_deploys(cluster, monkeypatch):
    """configs/cluster.yaml as shipped, on the simulated Macs, with two things swapped:
    the model (the embedded one; nothing is downloaded here) and its KV pool's size."""
    import ray
    from ray import serve
    from ray.serve.schema import ServeDeploySchema
    from ray.util.state import list_actors

    from deployments.app import build_app

    serve.delete("auto")
    conf = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    ServeDeploySchema.model_validate(conf)
    args = dict(conf["applications"][0]["args"])
    args.pop("model")
    args["engine"] = {k: v for k, v in args["engine"].items() if k != "kv_cache_memory_fraction"}
    args["engine"]["num_gpu_blocks"] = 64
    monkeypatch.setenv(args["api_keys_env"], "sk-cluster")
    serve.run(build_app(args), name="shipped", route_prefix="/shipped")

    deployments = serve.status().applications["shipped"].deployments
    assert deployments["LLMServer"].replica_states.get("RUNNING") == 2      # initial_replicas
    assert deployments["OpenAIIngress"].replica_states.get("RUNNING") == 2  # min_replicas
    nodes = _alive_actor_nodes(list_actors, "ServeReplica:shipped:LLMServer")
    mac_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("mac")}
    assert len(nodes) == 2 and nodes <= mac_nodes, "one replica per Mac"

    url = cluster + "/shipped/v1"
    c = openai.OpenAI(base_url=url, api_key="sk-cluster", max_retries=0)
    out = c.completions.create(model=args["served_model_name"], prompt="hello", max_tokens=4)
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
    stream = c.chat.completions.create(model=args["served_model_name"], max_tokens=4, stream=True,
                                       messages=[{"role": "user", "content": "hi"}])
    assert [ch.choices[0].finish_reason for ch in stream if ch.choices][-1] == "length"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    # A chain of stored responses, through the store replica the ingress replicas share.
    r = c.responses.create(model=args["served_model_name"], input="hello", max_output_tokens=2)
    for turn in range(8):
        r = c.responses.create(model=args["served_model_name"], input=f"turn {turn}", max_output_tokens=2,
                               previous_response_id=r.id)
    assert len(c.responses.input_items.list(r.id, limit=100).data) == 2 * 9 - 1
    serve.delete("shipped")
