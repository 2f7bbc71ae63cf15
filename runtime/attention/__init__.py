"""Paged attention: the seam between mlx-lm's models and our KV pool.

mlx-lm attention layers call `scaled_dot_product_attention(q, k, v, cache=..., ...)`
from their own module. `install_hook` wraps that name in each model module so that
when `cache` is one of our paged layer caches, attention reads K/V straight from the
block pool through a backend; any other cache falls through to mlx-lm unchanged.
Backends take one group of sequences: `attend_group(q, k_pool, v_pool, group, scale,
block_size, sinks) -> out`. On CUDA the `cuda` backend's short prefill chunks go
through a fused kernel of their own (paged_prefill.py, `prefill_fn`).
"""

import logging
import sys
import time
from functools import partial
from typing import Callable

import mlx.core as mx
import numpy as np

from . import gather, paged_kernel, paged_prefill
from .device import available
from .metadata import AttentionMetadata, GroupMetadata, build_metadata, flatten, make_group, sort_key

log = logging.getLogger(__name__)
AttendFn = Callable[..., mx.array]

BACKENDS: dict[str, AttendFn] = {"gather": gather.attend_group, "cuda": paged_kernel.attend_cuda,
                                 "metal": paged_kernel.attend_metal}
# The fused kernels, by the GPU backend they need; `auto` tries them in this order.
KERNELS = ("cuda", "metal")
# Backends that read each sequence's own context in place, so a decode group of mixed
# lengths costs them no padding and need not be split.
PADDING_FREE = set(KERNELS)


def get_backend(name: str) -> AttendFn:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; available: "
                         f"{sorted(BACKENDS) + ['auto']}") from None


def decode_problem(batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
                    block_size: int, dtype, seed: int = 0):
    """A random decode group over a random pool, contexts spread up to `context`."""
    rng = np.random.default_rng(seed)
    blocks_per = -(-context // block_size)
    num_blocks = batch * blocks_per
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k = mx.array(rng.standard_normal(shape), dtype=dtype)
    v = mx.array(rng.standard_normal(shape), dtype=dtype)
    q = mx.array(rng.standard_normal((batch, heads, 1, head_dim)), dtype=dtype)
    lens = np.maximum(1, (np.arange(1, batch + 1) * context) // batch)
    perm = rng.permutation(num_blocks)
    tables = [perm[i * blocks_per:(i + 1) * blocks_per][: -(-n // block_size)].tolist()
              for i, n in enumerate(lens)]
    group = make_group(*flatten(tables), (lens - 1).tolist(), [1] * batch, lens, 0, block_size)
    return q, k, v, group


def _time(fn, reps: int = 5) -> float:
    mx.eval(fn())
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - t) / reps


def check_backend(name: str, heads: int, kv_heads: int, head_dim: int, block_size: int,
                  dtype, batch: int = 32, context: int = 1024, window: int | None = None,
                  sinks: bool = False) -> tuple[bool, str]:
    """Does `name` match `gather` on random decode problems (with `window`, a sliding
    window's too; with `sinks`, with attention sinks in one split and in several), and
    is it faster on this geometry? Returns (use it, why)."""
    fn = BACKENDS[name]
    tol = 2e-3 if dtype == mx.float32 else 3e-2
    scale = head_dim ** -0.5
    try:
        cases = [(3, 40, None, False), (5, 700, None, False)]
        cases += [(5, 700, window, False)] if window else []
        cases += [(3, 40, window, True), (5, 700, None, True)] if sinks else []
        for b, ctx, w, with_sinks in cases:
            q, k, v, g = decode_problem(b, ctx, heads, kv_heads, head_dim, block_size, dtype, seed=b)
            s = mx.array(np.random.default_rng(b).standard_normal(heads), dtype=dtype) if with_sinks else None
            want = gather.attend_group(q, k, v, g, scale, block_size, s, window=w).astype(mx.float32)
            got = fn(q, k, v, g, scale, block_size, s, window=w).astype(mx.float32)
            err = float(mx.abs(got - want).max().item())
            if not err <= tol:
                what = name + (f" with a {w}-token window" if w else "") + (" with sinks" if with_sinks else "")
                return False, f"{what} differs from gather by {err:.3g} (tolerance {tol})"
        q, k, v, g = decode_problem(batch, context, heads, kv_heads, head_dim, block_size, dtype)
        t_kernel = _time(lambda: fn(q, k, v, g, scale, block_size))
        t_gather = _time(lambda: gather.attend_group(q, k, v, g, scale, block_size))
    except Exception as e:  # a kernel that fails to compile or run is not used
        return False, f"{name} failed its self-check: {e!r}"
    faster = t_kernel < t_gather
    return faster, (f"{name} {t_kernel * 1e3:.3f} ms vs gather {t_gather * 1e3:.3f} ms "
                    f"(batch {batch}, context {context})")


def resolve_backend(name: str, heads: int, kv_heads: int, head_dim: int, block_size: int,
                    dtype, window: int | None = None, sinks: bool = False) -> tuple[str, str]:
    """The backend to run, and why. `auto` picks a fused kernel only if this device has
    one, it matches `gather` (for a model with sliding-window layers, over `window` too;
    for one with attention sinks, with sinks), and it is faster on the model's geometry."""
    if name != "auto":
        get_backend(name)
        if name in KERNELS and (why := _cannot_run(name, heads, kv_heads, head_dim)):
            raise ValueError(f"attention backend {name!r} cannot serve this model: {why}")
        return name, "configured"
    reasons = []
    for cand in KERNELS:
        if why := _cannot_run(cand, heads, kv_heads, head_dim):
            reasons.append(f"{cand}: {why}")
            continue
        ok, why = check_backend(cand, heads, kv_heads, head_dim, block_size, dtype, window=window, sinks=sinks)
        reasons.append(why)
        if ok:
            return cand, why
    return "gather", "; ".join(reasons)


# Ragged hits over ragged contexts with padding sequences; two whole short prompts.
PREFILL_CHECKS = (([64, 37, 5], [2112, 1500, 1100]), ([2, 2], [70, 64]))


def check_prefill_kernel(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype) -> tuple[bool, str]:
    """Does the kernel match `gather` on random prefill steps of this geometry? Returns
    (use it, why). The kernel runs only on CUDA machines; this check at start-up is its
    guard."""
    if why := paged_prefill.unsupported(heads, kv_heads, head_dim, dtype):
        return False, why
    tol = 3e-2
    scale = head_dim ** -0.5
    try:
        for seed, (lengths, contexts) in enumerate(PREFILL_CHECKS):
            q, k, v, meta = paged_prefill.prefill_problem(lengths, contexts, heads, kv_heads, head_dim,
                                                          block_size, dtype, seed)
            want = paged_attention(q, k, v, meta, scale, gather.attend_group)
            got = paged_attention(q, k, v, meta, scale, gather.attend_group, prefill=paged_prefill.paged_prefill)
            err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item())
            if not err <= tol:
                return False, f"prefill kernel differs from gather by {err:.3g} (tolerance {tol})"
    except Exception as e:  # a kernel that fails to compile or run is not used
        return False, f"prefill kernel failed its self-check: {e!r}"
    return True, "prefill kernel matches gather"


def prefill_fn(name: str, heads: int, kv_heads: int, head_dim: int, block_size: int,
               dtype) -> tuple[AttendFn | None, str]:
    """What attends the short prefill chunks of the resolved backend `name`, and why:
    on `cuda`, the fused prefill kernel (paged_prefill.py) where it serves the geometry
    and passes its self-check; None (the backend's own way) otherwise."""
    if name != "cuda":
        return None, f"short prefill chunks through {name}"
    ok, why = check_prefill_kernel(heads, kv_heads, head_dim, block_size, dtype)
    return (paged_prefill.paged_prefill if ok else None), why


def _cannot_run(name: str, heads: int, kv_heads: int, head_dim: int) -> str | None:
    if not available(name):
        return f"not available on {mx.default_device()}"
    return paged_kernel.unsupported(heads, kv_heads, head_dim)


def paged_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, meta: AttentionMetadata,
                    scale: float, attend: AttendFn, sinks: mx.array | None = None,
                    prefill: AttendFn | None = None, window: int | None = None) -> mx.array:
    """q: (T, H, 1, D) packed rows -> (T, H, 1, D), one backend call per group; rows
    that pad the batch (`meta.pad_rows`) get zeros. `prefill` (`prefill_fn`) takes the
    short prefill groups it serves, in their packed rows. A sliding-window layer
    (`window`) reads only its window's blocks: decodes through the backend (the fused
    kernels from the window's first key), the rest through `gather`
    (`GroupMetadata.windowed`); the prefill kernel attends whole contexts."""
    if window is not None:
        attend, prefill = partial(attend, window=window), None
    outs = []
    whole = len(meta.groups) == 1 and not meta.pad_rows
    for g in meta.groups:
        rows = q if whole else q[g.row_start:g.row_end]           # (Tg, H, 1, D)
        if prefill is not None and paged_prefill.serves(g, rows, k_pool, sinks):
            outs.append(prefill(rows, k_pool, v_pool, g, scale, meta.block_size))
            continue
        if g.single_query:
            outs.append(attend(rows, k_pool, v_pool, g, scale, meta.block_size, sinks))
            continue
        # Reshapes rather than index-and-squeeze or expand: each is one primitive, and a
        # host-bound step queues every primitive of every layer (bench/step_ops.py).
        tg, h, _, d = rows.shape
        if g.query_rows is None:
            qg = rows.reshape(1, tg, h, d)                            # (1, Lq, H, D)
        else:
            qg = rows.reshape(tg, h, d)[g.query_rows]                 # (B, Lq, H, D)
        out = attend(qg.transpose(0, 2, 1, 3), k_pool, v_pool, g, scale, meta.block_size, sinks)
        out = out.transpose(0, 2, 1, 3).reshape(-1, h, 1, d)          # (B * Lq, H, 1, D)
        outs.append(out if g.out_rows is None else out[g.out_rows])
    if meta.pad_rows:
        outs.append(mx.zeros((meta.pad_rows, *q.shape[1:]), q.dtype))
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


__all__ = ["AttentionMetadata", "GroupMetadata", "available", "build_metadata", "check_backend", "get_backend",
           "install_hook", "paged_attention", "prefill_fn", "resolve_backend", "sort_key", "BACKENDS", "PADDING_FREE"]
