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
    k = gather_kv(k_pool, g.block_tables, block_size)
    v = gather_kv(v_pool, g.block_tables, block_size)
    mask = g.additive_mask(q.dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
