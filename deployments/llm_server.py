"""`LLMServer`: one engine per Ray Serve replica.

It loads the model in its constructor and streams `RequestOutput`s to the ingress. A
bad request comes back as one `{"error": ...}` item rather than an exception, so the
ingress can answer 400 before it starts a stream.
"""

import itertools
import logging
import uuid

from runtime import AsyncEngine, EngineConfig, SamplingParams
from runtime.errors import EngineDeadError, InvalidRequestError, PromptTooLongError

log = logging.getLogger("ray.serve")

ROUTING_HASH_LIMIT = 4096   # block hashes a replica reports to the router, most recent first


def error_item(e: Exception) -> dict:
    code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else None
    return {"error": {"message": str(e), "type": "invalid_request_error",
                      "param": getattr(e, "param", None), "code": code}}


class LLMServer:
    def __init__(self, engine_config: dict, stream_interval_s: float = 0.0):
        self.engine = AsyncEngine(EngineConfig(**engine_config))
        self.stream_interval_s = stream_interval_s
        try:
            from ray import serve
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:
            self.replica_id = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        log.info("LLMServer %s ready: %s", self.replica_id, engine_config.get("model"))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None):
        request_id = f"{self.replica_id}-{next(self._ids)}"
        try:
            async for out in self.engine.generate(None, params, request_id,
                                                  prompt_token_ids=prompt_token_ids,
                                                  priority=priority, cache_salt=cache_salt,
                                                  stream_interval_s=self.stream_interval_s):
                if out.finished:
                    out.replica_id = self.replica_id
                    out.engine_stats = self.stats()
                yield out
        except InvalidRequestError as e:
            yield error_item(e)

    def model_info(self) -> dict:
        return {"max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size,
                "block_size": self.engine.config.block_size}

    def stats(self) -> dict:
        return {"replica_id": self.replica_id, **self.engine.stats()}

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop has died."""
        self.engine.check_health()

    def record_routing_stats(self) -> dict:
        """Load and a bounded set of the prefix-cache block hashes this replica holds,
        for prefix-aware routing."""
        try:
            self.engine.check_health()
        except EngineDeadError:
            return {"dead": True}
        s = self.engine.stats()
        return {"load": s["running"] + s["waiting"], "running": s["running"], "waiting": s["waiting"],
                "kv_cache_usage": s["kv_cache_usage"], "block_size": s["block_size"],
                "block_hashes": self.engine.cached_block_hashes(ROUTING_HASH_LIMIT)}

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=1.0)
