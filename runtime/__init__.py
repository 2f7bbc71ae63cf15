"""mlx-paged-serve's engine: paged KV cache, prefix caching and continuous batching
over mlx-lm models. No Ray and no HTTP here."""

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["AsyncEngine", "CompletionOutput", "EngineConfig", "LLMEngine", "Logprob",
           "RequestOutput", "SamplingParams"]


def __getattr__(name):
    if name == "AsyncEngine":
        from .async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
