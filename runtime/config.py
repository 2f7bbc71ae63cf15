"""Engine configuration: one flat dataclass, so the HTTP layer can expose it as-is."""

from dataclasses import dataclass

from .models import default_model_path


@dataclass
class EngineConfig:
    """Knobs of one engine (one replica).

    KV memory comes from `kv_cache_memory_bytes` when set, else from
    `kv_cache_memory_fraction` of the device memory; `num_gpu_blocks` overrides both
    (tests use it to force preemption). `async_scheduling` queues step N+1 on the device
    before step N's tokens are read back (mlx-lm's `mx.async_eval` pipelining).
    `compile_decode` runs decode-only steps through `mx.compile` (decode_graph.py);
    None turns it on where it was measured to pay: every decode step with the fused
    CUDA kernel, decode steps of up to 8 sequences with `gather`.
    `graph_prefill_tokens`: prefill chunks of up to this many tokens (prefix-cache
    hits, chat turns) run in that compiled graph beside the step's decodes, one row a
    token, where the step's rows fit a batch bucket traced at start-up (start-up
    traces up to `max_num_seqs` plus this many rows); 0 runs every prefill eagerly.
    `prefill_kernel`: with the `cuda` backend, short prefill chunks go through the
    fused paged prefill kernel (attention/paged_prefill.py); False keeps the matmul way
    (for A/B measurements).
    `fuse_projections` concatenates each layer's q/k/v and gate/up weights, so each
    set is one matmul (models/fuse.py). `device` ("cpu" or "gpu") overrides MLX's
    default device for the engine's process, e.g. to run replicas on a host's cores.
    `adapter_path`: a directory of LoRA (or DoRA) adapters that mlx-lm's fine-tuning
    wrote (`adapters.safetensors`, `adapter_config.json`), applied as mlx-lm applies them.
    `buffer_cache_bytes` bounds the freed device buffers MLX keeps for reuse (its cache
    limit, one per process); None bounds it by the KV pool (engine.py,
    `bound_buffer_cache`).
    `window_pool`: a model with both sliding-window and full-attention layers (Gemma 2
    and 3, gpt-oss) keeps its sliding layers' K/V in window slots lent to the blocks
    their windows reach (kv/window_slots.py), so a long context holds whole blocks for
    its full-attention layers only; False keeps every layer's whole context in the one
    pool (for A/B measurements).
    """

    model: str = str(default_model_path())
    adapter_path: str | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.3
    kv_cache_dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    enable_continuous_batching: bool = True
    attention_backend: str = "auto"
    compile_decode: bool | None = None
    graph_prefill_tokens: int = 0
    prefill_kernel: bool = True
    fuse_projections: bool = True
    async_scheduling: bool = True
    seed: int = 0
    trust_remote_code: bool = False
    device: str | None = None
    buffer_cache_bytes: int | None = None
    window_pool: bool = True

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must cover max_model_len")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks must be at least 1")
        if self.device not in (None, "cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {self.device!r}")
        if self.graph_prefill_tokens < 0:
            raise ValueError("graph_prefill_tokens must be at least 0")
        if self.buffer_cache_bytes is not None and self.buffer_cache_bytes < 0:
            raise ValueError("buffer_cache_bytes must be at least 0")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
