"""`ColocatedServer`: the OpenAI front and one engine in one Serve replica.

With `colocate: true` the app is this one deployment: each replica answers HTTP and
holds an `LLMServer` (and its engine process) in-process, so no request or stream chunk
crosses Ray between the front and the engine. Serve's proxy (or HAProxy, or direct
ingress) picks the replica; prefix-aware routing, which needs the prompt's token ids
before a replica is chosen, is only available with the two deployments apart.
"""

from .ingress import OpenAIIngress
from .llm_client import LocalLLM
from .llm_server import LLMServer


class ColocatedServer(OpenAIIngress):
    def __init__(self, server_args: dict, settings: dict, max_requests: int | None = None, store=None):
        self.server = LLMServer(**server_args)
        super().__init__(LocalLLM(self.server, max_requests), settings, store)

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop has died."""
        self.server.check_health()
