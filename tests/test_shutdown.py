"""Graceful shutdown: replicas being replaced finish their in-flight streams first."""

import json
import threading

import httpx
import pytest

from .serving import free_port


@pytest.fixture(scope="module")
def serve_instance(tmp_path_factory):
    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")), log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _app(seed: int, colocate: bool):
    from deployments.app import AppArgs, build_app

    split = {} if colocate else {"ingress": {"ray_actor_options": {"num_cpus": 0.1},
                                             "graceful_shutdown_timeout_s": 60}}
    return build_app(AppArgs(
        served_model_name="default", engine={"seed": seed, "kv_cache_memory_bytes": 16 << 20},
        llm_server={"ray_actor_options": {"num_cpus": 0.5}, "graceful_shutdown_timeout_s": 60},
        colocate=colocate, **split))


def _draining(serve) -> bool:
    deployments = serve.status().applications["g"].deployments
    return any(d.replica_states.get("STOPPING", 0) > 0 for d in deployments.values())


@pytest.mark.parametrize("colocate", [False, True], ids=["split", "colocated"])
def test_redeploy_drains_in_flight_streams(serve_instance, colocate):
    from ray import serve

    serve.run(_app(0, colocate), name="g", route_prefix="/")
    body = {"model": "default", "prompt": "The river", "max_tokens": 3000, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    chunks, reasons, tokens = 0, [], 0
    redeployed = threading.Event()
    replaced_mid_stream = False
    with httpx.stream("POST", serve_instance + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            chunks += 1
            tokens = (ev.get("usage") or {}).get("completion_tokens", tokens)
            reasons += [c["finish_reason"] for c in ev["choices"] if c["finish_reason"]]
            if not reasons and chunks % 10 == 0 and _draining(serve):
                replaced_mid_stream = True
            if chunks == 3 and not redeployed.is_set():
                # replace the app's deployments while this stream is running
                threading.Thread(target=lambda: (serve.run(_app(1, colocate), name="g", route_prefix="/"),
                                                 redeployed.set()), daemon=True).start()
    assert redeployed.wait(120), "the redeploy did not finish"
    print(f"stream of {chunks} chunks finished; its replicas were stopping while it ran: "
          f"{replaced_mid_stream}")
    # Serve was stopping the old replicas before this stream ended, yet the stream, pinned
    # to them, ran to its last token: they drained instead of dying.
    assert replaced_mid_stream
    assert reasons == ["length"] and tokens == 3000
    r = httpx.post(serve_instance + "/v1/completions",
                   json={"model": "default", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
