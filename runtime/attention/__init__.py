"""Paged attention: the seam between mlx-lm's models and our KV pool.

mlx-lm attention layers call `scaled_dot_product_attention(q, k, v, cache=..., ...)`
from their own module. `install_hook` wraps that name in each model module so that
when `cache` is one of our paged layer caches, attention reads K/V straight from the
block pool through a backend; any other cache falls through to mlx-lm unchanged.
Backends take one group of sequences: `attend_group(q, k_pool, v_pool, group, scale,
block_size, sinks) -> out`.
"""

import sys
from typing import Callable

import mlx.core as mx

from . import gather
from .metadata import AttentionMetadata, GroupMetadata, build_metadata, sort_key

AttendFn = Callable[..., mx.array]

BACKENDS: dict[str, AttendFn] = {"gather": gather.attend_group}


def get_backend(name: str) -> AttendFn:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}") from None


def paged_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, meta: AttentionMetadata,
                    scale: float, attend: AttendFn, sinks: mx.array | None = None) -> mx.array:
    """q: (T, H, 1, D) packed rows -> (T, H, 1, D), one backend call per group."""
    outs = []
    for g in meta.groups:
        rows = q[g.row_start:g.row_end]                           # (Tg, H, 1, D)
        if g.single_query:
            outs.append(attend(rows, k_pool, v_pool, g, scale, meta.block_size, sinks))
            continue
        rows = rows[:, :, 0, :]                                   # (Tg, H, D)
        qg = rows[None] if g.query_rows is None else rows[g.query_rows]   # (B, Lq, H, D)
        out = attend(qg.transpose(0, 2, 1, 3), k_pool, v_pool, g, scale, meta.block_size, sinks)
        out = out.transpose(0, 2, 1, 3)
        out = out.reshape(-1, *out.shape[2:])
        if g.out_rows is not None:
            out = out[g.out_rows]
        outs.append(out[:, :, None, :])
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def _make_hook(original):
    from ..kv.paged_cache import PagedLayerCache

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, PagedLayerCache):
            return cache.attend(queries, scale, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.__wrapped_paged__ = original
    return scaled_dot_product_attention


def install_hook(model) -> list[str]:
    """Route the model's attention through `PagedLayerCache.attend`. Returns the
    modules patched; idempotent, and harmless to mlx-lm's own caches."""
    import mlx_lm.models.base as base

    patched = []
    names = {type(model).__module__} | {type(m).__module__ for _, m in model.named_modules()}
    for name in sorted(n for n in names if n.startswith("mlx_lm.models.")):
        module = sys.modules[name]
        fn = getattr(module, "scaled_dot_product_attention", None)
        if fn is base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = _make_hook(fn)
            patched.append(name)
        elif fn is not None and hasattr(fn, "__wrapped_paged__"):
            patched.append(name)
    return patched


__all__ = ["AttentionMetadata", "GroupMetadata", "build_metadata", "get_backend",
           "install_hook", "paged_attention", "sort_key", "BACKENDS"]
