"""How the ingress reaches an `LLMServer`: through a Serve handle, or in its own process.

`RemoteLLM` calls `LLMServer` replicas through a `DeploymentHandle`: the request router
(prefix-aware on a cluster) picks the replica, and every request and stream chunk is a
Ray message between the two. `LocalLLM` holds the `LLMServer` in the ingress's own
replica (`colocate: true`): no Ray hop per request or chunk, at the price of routing,
which is then only Serve's choice of ingress replica. Both give the same four calls; a
stream from either supports `async for`, `__anext__` and `cancel()`.
"""

import asyncio
from typing import Any, AsyncIterator


class RemoteLLM:
    def __init__(self, handle):
        self._handle = handle
        self._streaming = handle.options(stream=True)

    def generate(self, *args) -> Any:
        """A `DeploymentResponseGenerator` over the replica's outputs."""
        return self._streaming.generate.remote(*args)

    async def model_info(self) -> dict:
        return await self._handle.model_info.remote()

    async def stats(self) -> dict:
        return await self._handle.stats.remote()

    async def health(self) -> dict:
        return await self._handle.health.remote()


class LocalStream:
    """An `LLMServer.generate` iterator shaped like Serve's response generator.
    `cancel()` closes it, which aborts the engine request and frees its blocks."""

    def __init__(self, gen: AsyncIterator):
        self._gen = gen

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._gen.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self._gen.aclose())


class Overloaded(Exception):
    """The in-process engine already holds as many requests as it may."""


class LocalLLM:
    """`max_requests`: requests the engine may hold (running and waiting) before new
    ones are refused with `Overloaded`, the in-process counterpart of Serve's
    `max_queued_requests`; None for no limit here (Serve's own limits still apply)."""

    def __init__(self, server, max_requests: int | None = None):
        self.server = server
        self.max_requests = max_requests

    def generate(self, *args) -> LocalStream:
        # No await comes between this check and the engine counting the request (on
        # the stream's first step), so concurrent requests cannot all pass it at once.
        if self.max_requests is not None and self.server.engine.live_streams >= self.max_requests:
            raise Overloaded(f"{self.server.engine.live_streams} requests in progress")
        return LocalStream(self.server.generate(*args))

    async def model_info(self) -> dict:
        return self.server.model_info()

    async def stats(self) -> dict:
        return self.server.stats()

    async def health(self) -> dict:
        return self.server.health()
