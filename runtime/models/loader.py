"""Load a model with mlx-lm and check that the paged engine can run it."""

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import UnsupportedModelError


def load(path_or_repo: str, trust_remote_code: bool = False, adapter_path: str | None = None):
    """`mlx_lm.load` on a local directory or a hub repo id (`mlx-community/...`), with
    the LoRA adapters in `adapter_path` if given. Returns (model, tokenizer wrapper,
    config dict)."""
    from mlx_lm import load as mlx_load

    if not Path(path_or_repo).exists() and "/" not in path_or_repo:
        raise FileNotFoundError(f"model {path_or_repo!r} is neither a directory nor a hub repo id")
    if adapter_path is not None and not (Path(adapter_path) / "adapter_config.json").exists():
        raise FileNotFoundError(f"adapter_path {adapter_path!r} is not a directory of mlx-lm adapters "
                                "(adapter_config.json and adapters.safetensors)")
    try:
        model, tokenizer, config = mlx_load(
            path_or_repo, return_config=True, adapter_path=adapter_path,
            tokenizer_config={"trust_remote_code": trust_remote_code} if trust_remote_code else None)
    except ValueError as e:
        if "not supported" in str(e):
            raise UnsupportedModelError(str(e)) from e
        raise
    check_supported(model, config)
    return model, tokenizer, config


def load_tokenizer(path_or_repo: str):
    """The tokenizer alone (no weights), from a directory or a hub repo."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    path = Path(path_or_repo)
    if not path.exists():
        from huggingface_hub import snapshot_download
        path = Path(snapshot_download(path_or_repo, allow_patterns=[
            "*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]))
    return mlx_load_tokenizer(path)


def check_supported(model, config: dict) -> None:
    """Full-attention and sliding-window KV caches map onto blocks (`layer_windows`).
    Chunked, quantized-KV and recurrent (SSM) caches are refused with a clear message."""
    if not hasattr(model, "layers") or not hasattr(model, "args"):
        raise UnsupportedModelError(f"model type {config.get('model_type', type(model).__module__)!r} "
                                    "does not expose layers and args")
    layer_windows(model, config.get("model_type"))


def layer_windows(model, model_type: str | None = None) -> list[int | None]:
    """Each layer's attention window, from the caches mlx-lm makes for the model: None
    for a full-attention `KVCache`, W for a `RotatingKVCache` of `max_size` W (and no
    kept prefix), whose layer attends its last W tokens (Gemma 2 and 3, gpt-oss, Mistral's
    sliding layers). The paged engine attends such a layer over its window's blocks, and
    keeps its K/V in window slots lent to the blocks its windows reach
    (kv/window_slots.py) where the model has full-attention layers too, so prefixes stay
    shareable."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    model_type = model_type or type(model).__module__
    caches = model.make_cache() if hasattr(model, "make_cache") else None
    if caches is None:
        return [None] * len(model.layers)
    windows = []
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            windows.append(None)
        elif type(c) is RotatingKVCache and c.keep == 0:
            windows.append(int(c.max_size))
        else:
            raise UnsupportedModelError(
                f"model type {model_type!r} uses {type(c).__name__} at layer {i}; the paged engine "
                "supports full-attention and sliding-window KV caches only (no chunked, quantized "
                "or SSM state)")
    return windows


def has_attention_sinks(model) -> bool:
    """Whether the model's attention layers hold sink logits (gpt-oss's `sinks`), which
    mlx-lm hands to attention beside the keys."""
    from mlx.utils import tree_flatten

    return any(name == "sinks" or name.endswith(".sinks") for name, _ in tree_flatten(model.parameters()))


def kv_geometry(model) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from the model's args."""
    args = model.args
    heads = args.num_attention_heads
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    return len(model.layers), kv_heads, head_dim


def activation_dtype(model) -> mx.Dtype:
    """The dtype K/V come out in: that of the first floating parameter (quantized
    layers keep their scales in it)."""
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float16


def max_context(config: dict) -> int:
    text = config.get("text_config", config)
    return int(text.get("max_position_embeddings") or 4096)
