"""Portable paged attention: gather each group's blocks into contiguous K/V, then SDPA.

Pure MLX, so it runs on Metal, CUDA and CPU alike; the fused kernels are checked
against it.
"""

import mlx.core as mx

from .metadata import GroupMetadata


def gather_kv(pool: mx.array, block_tables: mx.array, block_size: int) -> mx.array:
    """(num_slots, Hkv, D) pool -> (B, Hkv, max_blocks * block_size, D)."""
    num_slots, n_kv, d = pool.shape
    blocks = pool.reshape(num_slots // block_size, block_size, n_kv, d)[block_tables]
    b, nb = block_tables.shape
    return blocks.reshape(b, nb * block_size, n_kv, d).transpose(0, 2, 1, 3)


def attend_group(q: mx.array, k_pool: mx.array, v_pool: mx.array, g: GroupMetadata,
                 scale: float, block_size: int, sinks: mx.array | None = None) -> mx.array:
    """q: (B, H, Lq, D) -> (B, H, Lq, D)."""
    if g.unfused and sinks is None:
        return attend_unfused(q, k_pool, v_pool, g, scale, block_size)
    k = gather_kv(k_pool, g.block_tables, block_size)
    v = gather_kv(v_pool, g.block_tables, block_size)
    mask = g.additive_mask(q.dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def attend_unfused(q: mx.array, k_pool: mx.array, v_pool: mx.array, g: GroupMetadata,
                   scale: float, block_size: int) -> mx.array:
    """`attend_group` as two matmuls and a softmax (in float32), each query head's
    scores against its KV head's keys: no fused kernel, so on CUDA no attention plan for
    the shape. q: (B, H, Lq, D) -> (B, H, Lq, D)."""
    b, h, lq, d = q.shape
    k = gather_kv(k_pool, g.block_tables, block_size)
    v = gather_kv(v_pool, g.block_tables, block_size)
    n_kv = k.shape[1]
    qg = (q * scale).reshape(b, n_kv, (h // n_kv) * lq, d)
    scores = (qg @ k.swapaxes(-1, -2)).reshape(b, n_kv, h // n_kv, lq, -1)
    scores = scores + g.additive_mask(q.dtype)[:, :, None]
    p = mx.softmax(scores, axis=-1, precise=True).reshape(b, n_kv, (h // n_kv) * lq, -1)
    return (p @ v).reshape(b, h, lq, d)
