"""The Ray Serve application: `serve run configs/config.yaml` builds it with `build_app`.

No `from __future__ import annotations` here: Serve reads the builder's annotation to
turn the config's `args` into `AppArgs`.
"""

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve

from runtime import EngineConfig
from runtime.models import default_model_path
from runtime.prompt_token_cache import CAPACITY_TOKENS

from .colocated import ColocatedServer
from .ingress import OpenAIIngress
from .llm_server import LLMServer
from .response_store import BACKGROUND_LEASE_S, MAX_BYTES, MAX_RESPONSES, ResponseStore


class DeploymentArgs(BaseModel):
    """Ray Serve options of one deployment. `max_ongoing_requests` left out means this
    deployment's default below, never Serve's own (5), which would hold an LLM replica
    or the ingress to five requests at a time."""

    model_config = ConfigDict(extra="forbid")
    num_replicas: Optional[int] = 1
    autoscaling_config: Optional[dict[str, Any]] = None
    max_ongoing_requests: Optional[int] = None
    max_queued_requests: int = -1
    max_replicas_per_node: Optional[int] = None
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    request_router_config: Optional[dict[str, Any]] = None
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    graceful_shutdown_timeout_s: float = 20.0


class ResponseStoreArgs(BaseModel):
    """The Responses API's store (response_store.py): one replica that every ingress
    replica calls, holding the newest responses in memory within both bounds."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    max_responses: int = Field(MAX_RESPONSES, ge=1)
    max_bytes: int = Field(MAX_BYTES, ge=1)
    background_lease_s: float = Field(BACKGROUND_LEASE_S, ge=2.0,
                                      description="a background response whose replica has not said it "
                                                  "runs it for this long reads as failed")
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0})


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: str = Field(default_factory=lambda: str(default_model_path()),
                       description="a model directory or a hub repo id (mlx-community/...)")
    served_model_name: Optional[str] = None
    engine: dict[str, Any] = Field(default_factory=dict,
                                   description="EngineConfig fields (runtime/config.py), model aside")
    llm_server: DeploymentArgs = Field(default_factory=lambda: DeploymentArgs(ray_actor_options={"num_cpus": 1}))
    ingress: DeploymentArgs = Field(default_factory=lambda: DeploymentArgs(ray_actor_options={"num_cpus": 0.2}))
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys; empty disables auth")
    api_keys_env: str = "MLX_PAGED_SERVE_API_KEYS"
    response_store: ResponseStoreArgs = Field(
        default_factory=ResponseStoreArgs,
        description="keeps Responses API responses made with store (the default) for "
                    "previous_response_id and GET/DELETE /v1/responses/{id}; enabled: false stores none")
    max_request_body_bytes: int = 1 << 20
    max_prompt_tokens: Optional[int] = None
    default_max_tokens: int = 256
    retry_after_s: int = 1
    health_timeout_s: float = 5.0
    tokenize_inline_chars: int = Field(
        256, ge=0, description="prompts and chat messages shorter than this many characters are "
                               "tokenized on the replica's event loop; longer ones on tokenizer "
                               "threads, where prompts that arrive together tokenize in parallel "
                               "and the loop serves other requests meanwhile, but each result "
                               "waits for the GIL while the loop is busy")
    tokenize_threads: int = Field(
        4, ge=1, description="threads per replica that tokenize prompts of tokenize_inline_chars "
                             "or more (at most the host's CPU count): the Rust tokenizer releases "
                             "the GIL, so this many long prompts that arrive together tokenize at "
                             "once; the rest wait their turn")
    prompt_token_cache_tokens: int = Field(
        CAPACITY_TOKENS, ge=0, description="tokens of recent long prompts (2,048 characters or "
                                           "more) each replica that answers HTTP keeps, so that a "
                                           "prompt that begins like one of them is tokenized only "
                                           "past the shared start (a system prompt or document "
                                           "before each question, a chat's growing history); about "
                                           "12 bytes a token besides the texts; 0 turns it off")
    switch_interval_ms: Optional[float] = Field(
        None, gt=0, description="Python's thread switch interval (sys.setswitchinterval) in each "
                                "replica that answers HTTP or holds an engine: how long a thread "
                                "that wants the GIL (Ray's, the engine's sender and receiver, a "
                                "tokenizer's) may wait while another runs Python; null keeps "
                                "Python's 5 ms")
    stream_interval_ms: float = Field(
        50.0, ge=0, description="after a stream's first chunk, at most one chunk per interval per "
                                "request (the last at once): each chunk costs a Ray message through "
                                "replica, ingress and proxy; 0 streams every engine step")
    max_stream_chunks_per_s: float = Field(
        1000.0, ge=0, description="cap on the chunks a replica streams per second, all requests "
                                  "together: with many live streams each one's interval grows to "
                                  "streams / cap, since per-chunk Ray messages otherwise slow the "
                                  "engine; 0 for no cap")

    colocate: bool = Field(
        False, description="one deployment whose replicas each answer HTTP and hold an engine "
                           "(`llm_server` options apply to it; `ingress` must be left unset): "
                           "no Ray hop between front and engine per request or stream chunk; "
                           "no prefix-aware routing")
    engine_process: bool = Field(
        True, description="run each LLMServer's engine loop in a process of its own, so Ray's "
                          "per-message work in the replica and the engine's host work of a step "
                          "do not take turns on one GIL; false runs it on a thread of the replica")
    engine_nice: Optional[int] = Field(
        0, ge=-20, le=19, description="niceness of each LLMServer replica's process and its "
                                      "engine (MLX's threads too): Ray starts its workers at 15, "
                                      "where they wait behind every nice-0 process for CPU; "
                                      "lowering it needs privileges (else a warning, and "
                                      "RAY_worker_niceness=0 before `ray start` does it); "
                                      "null leaves Ray's")
    engine_stall_timeout_s: Optional[float] = Field(
        120.0, gt=0, description="a replica whose engine loop has not come round for this long "
                                 "(a step that never returns: a hung device, a deadlock) fails "
                                 "its health check: its requests get 503 at once, its engine "
                                 "process is killed and Serve replaces the replica; null never")
    engine_threads: Optional[int] = Field(
        None, ge=1, description="OMP_NUM_THREADS of each LLMServer's engine process: Ray sets 1 "
                                "for its workers, which slowed the served engine's decode on a GPU "
                                "host; default: pin_cpus when set, else the host's CPU count")
    share_replica_loop: bool = Field(
        True, description="run the handlers on each replica's own event loop, where Ray "
                          "receives its requests (RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 "
                          "in the replicas, as Ray's throughput-optimized mode sets it): no hop "
                          "between two loops, on two threads of one GIL, per request and per "
                          "stream chunk; false keeps Ray's default, a loop of their own")
    pin_cpus: Optional[int] = Field(
        None, ge=1, description="pin each LLMServer's engine (and MLX's threads) to this "
                                "many CPUs, replica rank r taking CPUs [r * n, (r + 1) * n) modulo "
                                "the host's count: for MLX's CPU backend when several replicas "
                                "share one host (Linux); Ray's own threads stay unpinned")

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: dict) -> dict:
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        unknown = sorted(set(v) - known)
        if unknown:
            raise ValueError(f"unknown engine fields {unknown}; known: {sorted(known)}")
        EngineConfig(**v)   # range checks
        return v

    @model_validator(mode="after")
    def _colocated(self):
        if self.colocate and "ingress" in self.model_fields_set:
            raise ValueError("with colocate: true there is no ingress deployment; set its "
                             "options under llm_server")
        if self.colocate and self.llm_server.request_router_config:
            raise ValueError("prefix-aware routing (request_router_config) needs the ingress "
                             "and LLMServer apart: drop it or colocate")
        return self


LLM_SERVER_MAX_ONGOING = 256   # the engine queues what it cannot run yet, by priority
INGRESS_MAX_ONGOING = 1024
OVERLOAD_MARGIN = 64           # colocated: requests past the limit that reach the replica


def _options(d: DeploymentArgs, max_ongoing: int, env: dict[str, str]) -> dict:
    """Serve options of one deployment; `env` goes into its replicas' environment,
    beneath any `runtime_env.env_vars` the config sets."""
    opts = d.model_dump(exclude_none=True)
    opts.setdefault("max_ongoing_requests", max_ongoing)
    if d.autoscaling_config:
        opts.pop("num_replicas", None)
    if env:
        actor = dict(opts.get("ray_actor_options") or {})
        runtime_env = dict(actor.get("runtime_env") or {})
        runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
        opts["ray_actor_options"] = {**actor, "runtime_env": runtime_env}
    return opts


def build_app(args: AppArgs) -> serve.Application:
    if isinstance(args, dict):
        args = AppArgs.model_validate(args)
    model = args.model
    if Path(model).exists():
        model = str(Path(model).resolve())
    keys = list(args.api_keys)
    env_keys = os.environ.get(args.api_keys_env, "")
    keys += [k.strip() for k in env_keys.split(",") if k.strip()]
    name = args.served_model_name or (Path(model).name if Path(model).exists() else model)
    engine = {**args.engine, "model": model}
    if engine.get("adapter_path") and Path(engine["adapter_path"]).exists():
        engine["adapter_path"] = str(Path(engine["adapter_path"]).resolve())   # replicas run elsewhere
    settings = {
        "model": model, "served_model_name": name, "api_keys": keys,
        "max_request_body_bytes": args.max_request_body_bytes,
        "max_prompt_tokens": args.max_prompt_tokens, "default_max_tokens": args.default_max_tokens,
        "retry_after_s": args.retry_after_s, "health_timeout_s": args.health_timeout_s,
        "tokenize_inline_chars": args.tokenize_inline_chars, "tokenize_threads": args.tokenize_threads,
        "prompt_token_cache_tokens": args.prompt_token_cache_tokens,
        "switch_interval_ms": args.switch_interval_ms,
        "created": int(time.time()),
    }
    server_args = {"engine_config": engine, "stream_interval_s": args.stream_interval_ms / 1e3,
                   "pin_cpus": args.pin_cpus, "max_stream_chunks_per_s": args.max_stream_chunks_per_s,
                   "engine_process": args.engine_process, "engine_nice": args.engine_nice,
                   "engine_threads": args.engine_threads, "stall_timeout_s": args.engine_stall_timeout_s,
                   "switch_interval_ms": args.switch_interval_ms}
    env = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"} if args.share_replica_loop else {}
    store = None
    if args.response_store.enabled:
        s = args.response_store
        opts = _options(DeploymentArgs(ray_actor_options=s.ray_actor_options), INGRESS_MAX_ONGOING, env)
        store = serve.deployment(ResponseStore, name="ResponseStore", **opts).bind(
            s.max_responses, s.max_bytes, s.background_lease_s)
    if args.colocate:
        opts, max_requests = _options(args.llm_server, LLM_SERVER_MAX_ONGOING, env), None
        if opts["max_queued_requests"] >= 0:
            # The engine holds what the two deployments would hold together (ongoing in
            # the replica plus queued before it) and refuses more with an OpenAI error
            # body. Serve passes a margin beyond that through, to be refused so, and
            # gets room to queue a burst while it assigns it (its own refusal is plain
            # text: Serve counts requests still being assigned as queued).
            max_requests = opts["max_ongoing_requests"] + opts["max_queued_requests"]
            opts["max_ongoing_requests"] = max_requests + OVERLOAD_MARGIN
            opts["max_queued_requests"] = max(max_requests, OVERLOAD_MARGIN)
        colocated = serve.deployment(ColocatedServer, name="OpenAIServer", **opts)
        return colocated.bind(server_args, settings, max_requests, store)
    server = serve.deployment(LLMServer, name="LLMServer",
                              **_options(args.llm_server, LLM_SERVER_MAX_ONGOING, env))
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress",
                               **_options(args.ingress, INGRESS_MAX_ONGOING, env))
    return ingress.bind(server.bind(**server_args), settings, store)
