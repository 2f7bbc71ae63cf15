"""Portable paged attention: gather each group's blocks into contiguous K/V, then SDPA.

Pure MLX, so it runs on Metal, CUDA and CPU alike; the fused kernels are checked
against it.
"""

import mlx.core as mx

from .device import available
from .metadata import GroupMetadata


# One 16-byte vector a thread: out[b, h, t, :] = pool[slot of token t of sequence b, h, :].
_GATHER_SOURCE = """
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const int n_kv = pool_shape[1];
    const int vecs = pool_shape[2] * sizeof(pool[0]) / 16;
    const int width = block_tables_shape[1];
    const long total = (long)block_tables_shape[0] * n_kv * width * BS * vecs;
    if (i >= total) return;
    const int v = i % vecs;
    long rest = i / vecs;
    const int t = rest % (width * BS);
    rest /= width * BS;
    const int h = rest % n_kv;
    const int b = rest / n_kv;
    const long slot = (long)block_tables[b * width + t / BS] * BS + t % BS;
    reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(pool)[(slot * n_kv + h) * vecs + v];
"""
GATHER_THREADS = 256
_gather_kernel = None


def _gather_cuda(pool: mx.array, block_tables: mx.array, block_size: int) -> mx.array:
    global _gather_kernel
    if _gather_kernel is None:
        _gather_kernel = mx.fast.cuda_kernel(name="paged_gather_kv", input_names=["pool", "block_tables"],
                                             output_names=["out"], source=_GATHER_SOURCE)
    _, n_kv, d = pool.shape
    b, nb = block_tables.shape
    total = b * n_kv * nb * block_size * d * pool.dtype.size // 16
    return _gather_kernel(inputs=[pool, block_tables], template=[("BS", block_size)],
                          grid=(-(-total // GATHER_THREADS) * GATHER_THREADS, 1, 1),
                          threadgroup=(GATHER_THREADS, 1, 1),
                          output_shapes=[(b, n_kv, nb * block_size, d)], output_dtypes=[pool.dtype])[0]


def gather_by_indexing(pool: mx.array, block_tables: mx.array, block_size: int) -> mx.array:
    """`gather_kv` in MLX ops: a gather of whole blocks, then a transpose (a second copy
    once an op needs it contiguous)."""
    num_slots, n_kv, d = pool.shape
    blocks = pool.reshape(num_slots // block_size, block_size, n_kv, d)[block_tables]
    b, nb = block_tables.shape
    return blocks.reshape(b, nb * block_size, n_kv, d).transpose(0, 2, 1, 3)


def gather_kv(pool: mx.array, block_tables: mx.array, block_size: int) -> mx.array:
    """(num_slots, Hkv, D) pool -> (B, Hkv, max_blocks * block_size, D). On CUDA one
    kernel copies 16-byte vectors straight into that layout: MLX's indexing and the
    transpose after it reached a tenth of the H200's bandwidth."""
    if _gather_on_cuda(pool):
        return _gather_cuda(pool, block_tables, block_size)
    return gather_by_indexing(pool, block_tables, block_size)


def _gather_on_cuda(pool: mx.array) -> bool:
    return (pool.shape[2] * pool.dtype.size) % 16 == 0 and available("cuda")


def attend_group(q: mx.array, k_pool: mx.array, v_pool: mx.array, g: GroupMetadata,
                 scale: float, block_size: int, sinks: mx.array | None = None,
                 window: int | None = None) -> mx.array:
    """q: (B, H, Lq, D) -> (B, H, Lq, D). `window`: a sliding-window layer's, which
    attends each query's last `window` keys, and reads only the blocks they are in
    (`GroupMetadata.windowed`)."""
    # A windowed layer with sinks (gpt-oss's) takes the matmul way too. It was sent there
    # on a suspicion of MLX's fused attention with sinks on CUDA, where a gpt-oss-shaped
    # model's logprobs read 0.13-0.45 off mlx-lm's (H100); that did not close the gap,
    # a standalone check found the fused attention exact, and the cause was MLX's CUDA
    # mixture of experts (bench/moe_determinism.py). The way is kept for its speed: a window's
    # decode read in 0.12 ms at 8,192 tokens x 128 sequences, against 0.43 ms fused
    # without sinks (H200, `bench/sliding_window.py`).
    grouped = (g.unfused and sinks is None) or (window is not None and sinks is not None)
    if window is None:
        tables, mask = g.block_tables, g.additive_mask(q.dtype, grouped)
    else:
        tables, mask = g.windowed(window, block_size, q.dtype, grouped)
    k = gather_kv(k_pool, tables, block_size)
    v = gather_kv(v_pool, tables, block_size)
    if grouped:
        return attend_unfused(q, k, v, mask, scale, sinks)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def attend_unfused(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float,
                   sinks: mx.array | None = None) -> mx.array:
    """SDPA as two matmuls and a softmax (in float32), each query head's scores against
    its KV head's keys: no fused kernel, so on CUDA no attention plan for the shape.
    q: (B, H, Lq, D), k and v: (B, Hkv, S, D), mask: additive (B, 1, 1, Lq, S) ->
    (B, H, Lq, D). `sinks` (H,): each head's sink logit, a key of no value that takes
    its share of the softmax, as `mx.fast.scaled_dot_product_attention` takes them."""
    b, h, lq, d = q.shape
    n_kv = k.shape[1]
    qg = (q * scale).reshape(b, n_kv, (h // n_kv) * lq, d)
    scores = (qg @ k.swapaxes(-1, -2)).reshape(b, n_kv, h // n_kv, lq, -1)
    scores = scores + mask
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, n_kv, h // n_kv, 1, 1),
                               (*scores.shape[:-1], 1))
        scores = mx.concatenate([sink, scores], axis=-1)
    p = mx.softmax(scores, axis=-1, precise=True)
    if sinks is not None:
        p = p[..., 1:]
    return (p.reshape(b, n_kv, (h // n_kv) * lq, -1) @ v).reshape(b, h, lq, d)
