"""mlx-paged-serve's engine: paged KV cache, prefix caching and continuous batching
over mlx-lm models. No Ray and no HTTP here."""

import importlib
import resource


def _import_mlx_lm_raising_fd_limit_only() -> None:
    """Import mlx-lm with its file-descriptor limit change made raise-only.

    `mlx_lm.utils` sets RLIMIT_NOFILE to (2048, 4096) when first imported. That lifts
    macOS's default soft limit of 256 for models of many weight files, but it also
    lowers any higher limit, the hard one included, in every process that imports it
    and in everything that process starts: a replica or an ingress holding thousands of
    connections, HAProxy under Serve. Here the change can only raise either limit."""
    real = resource.setrlimit

    def higher(a: int, b: int) -> int:
        return resource.RLIM_INFINITY if resource.RLIM_INFINITY in (a, b) else max(a, b)

    def raise_only(which, limits):
        if which != resource.RLIMIT_NOFILE:
            return real(which, limits)
        now = resource.getrlimit(which)
        return real(which, (higher(limits[0], now[0]), higher(limits[1], now[1])))

    resource.setrlimit = raise_only
    try:
        importlib.import_module("mlx_lm.utils")
    finally:
        resource.setrlimit = real


_import_mlx_lm_raising_fd_limit_only()

from .config import EngineConfig  # noqa: E402
from .engine import LLMEngine  # noqa: E402
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402
from .structured_output import StructuredOutputsParams  # noqa: E402

__all__ = ["AsyncEngine", "CompletionOutput", "EngineConfig", "LLMEngine", "Logprob",
           "RequestMetrics", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name):
    if name == "AsyncEngine":
        from .async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
