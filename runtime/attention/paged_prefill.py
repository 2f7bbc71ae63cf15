"""Fused paged attention for short prefill chunks on CUDA (prefix-cache hits, chat turns).

A prefill group of up to `UNFUSED_MAX_QUERIES` new tokens a sequence was attended by
gathering its context into contiguous K/V and two matmuls: no fused-attention plan per
shape, but 0.69 ms a layer for a wave of 8 hits of 64 tokens over 2,112 keys on an
H200, several times what the work needs, and about 11 ms of a 16-layer hit step.
This kernel reads the block pool in place through the block table, as the decode
kernel does, and multiplies on the tensor cores (`mma.sync` m16n8k16, float32
accumulation), with an online softmax kept in registers:

- a thread block serves 64 rows of one (sequence, KV head): a row is one query and
  one query head of the KV head's group, so each K/V tile loaded serves every head;
- each of its 4 warps holds 16 rows; per tile of 64 keys it computes the scores, masks
  them causally by each row's position, rescales its running sums, and multiplies the
  probabilities (rounded to the input dtype) by V;
- K is staged in shared memory as it lies in the pool, V transposed, so both operands
  of both products load as 32-bit pairs.

A long context is split along the keys across thread blocks, as the decode kernel
splits it (flash-decoding), and the decode kernel's merge combines the splits.

It reads the step's packed rows (T, H, 1, D) as the model hands them over and writes
them so (`GroupMetadata.seq_rows` says where each sequence's rows start): no layout
copies before or after, where the matmul way queued seven primitives around its own.
A block past its sequence's rows (padding) returns at once. No plan, no per-shape
stall: two compiled kernels (whole, split) per dtype, head_dim, group size and block
size. bfloat16 and float16 only (the tensor-core inputs); other dtypes, and attention
sinks, keep the matmul way.
"""

import mlx.core as mx
import numpy as np

from .device import available
from .metadata import GroupMetadata, build_metadata
from .paged_kernel import kernel, merge_splits, scale_array

WARPS = 4
ROWS = WARPS * 16            # rows (query, head) a thread block serves
HEAD_DIMS = (64, 128)
DTYPES = (mx.bfloat16, mx.float16)

_HEADER = r"""
// pp_pack: two floats as one register of two T. pp_mma: c (16x8, f32) += a (16x16,
// row-major) * b (16x8, column-major), one warp. Both for each tensor-core input type.
template <typename T> __device__ __forceinline__ unsigned pp_pack(float lo, float hi);
template <typename T> __device__ __forceinline__ void pp_mma(float* c, const unsigned* a, unsigned b0, unsigned b1);
#define PP_TYPE(T, T2, CONVERT, PTX)                                                              \
template <> __device__ __forceinline__ unsigned pp_pack<T>(float lo, float hi) {                  \
    T2 v = CONVERT(lo, hi);                                                                       \
    return *reinterpret_cast<unsigned*>(&v);                                                      \
}                                                                                                 \
template <> __device__ __forceinline__ void pp_mma<T>(float* c, const unsigned* a, unsigned b0,   \
                                                      unsigned b1) {                              \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 "                     \
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                          \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                 \
}
PP_TYPE(__nv_bfloat16, __nv_bfloat162, __floats2bfloat162_rn, "bf16")
PP_TYPE(__half, __half2, __floats2half2_rn, "f16")
#undef PP_TYPE
"""

# Fragment layouts are PTX's for m16n8k16: lane = 4 * g + t; A holds rows g and g + 8,
# columns 2t, 2t + 1 and 8 more; B holds column g, rows 2t, 2t + 1 and 8 more; C holds
# rows g and g + 8, columns 2t and 2t + 1. A tile's scores in C layout are the
# probabilities' A layout for the second product, two 8-key blocks at a time.
_SOURCE = """
    constexpr int NT = 64;            // keys a tile
    constexpr int KP = D + 8;         // a staged key's row, padded against bank conflicts
    constexpr int VP = NT + 8;        // a staged value column's row (V is transposed)
    __shared__ uint4 ks_raw[NT * KP / 8];
    __shared__ uint4 vt_raw[D * VP / 8];
    T* ks = reinterpret_cast<T*>(ks_raw);
    T* vt = reinterpret_cast<T*>(vt_raw);

    const int n_split = gridDim.z / (seq_rows_shape[0]);
    const int b = blockIdx.z / n_split;
    const int split = blockIdx.z % n_split;
    const int h_kv = blockIdx.y;
    const int row0 = seq_rows[2 * b];        // the sequence's first row in q
    const int n_new = seq_rows[2 * b + 1];   // its rows (0: a padding sequence)
    const int tile0 = blockIdx.x * (NW * 16);
    if (tile0 >= n_new * G) return;          // the whole block: past this sequence's rows
    const int n_heads = q_shape[1];
    const int n_kv = k_pool_shape[1];
    const int n_tab = block_tables_shape[1];
    const int first_pos = context_lens[b] - n_new;
    // keys up to the tile's last query: its context, less what later queries add; of
    // those, this split's share, whole tiles of them
    const int ctx = first_pos + min(n_new, (tile0 + NW * 16 - 1) / G + 1);
    const int chunk = ((ctx + n_split - 1) / n_split + NT - 1) / NT * NT;
    const int k_begin = split * chunk;
    const int k_end = min(ctx, k_begin + chunk);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane >> 2;
    const int t = lane & 3;
    const float NEG_INF = -__int_as_float(0x7f800000);
    const float scale_log2 = scale[0] * 1.4426950408889634f;

    // This thread's two rows: (query, head of the group), query-major.
    int pos[2];
    bool valid[2];
    long row_off[2];
    for (int i = 0; i < 2; ++i) {
        const int r = tile0 + warp * 16 + g + 8 * i;
        const int qi = r / G;
        valid[i] = qi < n_new;
        const int qc = valid[i] ? qi : 0;
        pos[i] = first_pos + qc;
        row_off[i] = ((long)(row0 + qc) * n_heads + h_kv * G + r % G) * D;
    }
    unsigned qa[D / 16][4];
    for (int kc = 0; kc < D / 16; ++kc) {
        const int c = kc * 16 + 2 * t;
        qa[kc][0] = *reinterpret_cast<const unsigned*>(q + row_off[0] + c);
        qa[kc][1] = *reinterpret_cast<const unsigned*>(q + row_off[1] + c);
        qa[kc][2] = *reinterpret_cast<const unsigned*>(q + row_off[0] + c + 8);
        qa[kc][3] = *reinterpret_cast<const unsigned*>(q + row_off[1] + c + 8);
    }
    float acc[D / 8][4];
    for (int db = 0; db < D / 8; ++db)
        for (int e = 0; e < 4; ++e) acc[db][e] = 0.f;
    float m[2] = {NEG_INF, NEG_INF};
    float l[2] = {0.f, 0.f};

    for (int k0 = k_begin; k0 < k_end; k0 += NT) {
        __syncthreads();   // the previous tile is read
        for (int i = threadIdx.x; i < NT * D / 8; i += NW * 32) {
            const int key = i / (D / 8);
            const int dv = (i % (D / 8)) * 8;
            const int j = k0 + key;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (j < k_end) {
                const long slot = (long)block_tables[b * n_tab + j / BS] * BS + j % BS;
                const long base = (slot * n_kv + h_kv) * D + dv;
                kv = *reinterpret_cast<const uint4*>(k_pool + base);
                vv = *reinterpret_cast<const uint4*>(v_pool + base);
            }
            *reinterpret_cast<uint4*>(ks + key * KP + dv) = kv;
            const T* ve = reinterpret_cast<const T*>(&vv);
            for (int e = 0; e < 8; ++e) vt[(dv + e) * VP + key] = ve[e];
        }
        __syncthreads();

        float s[NT / 8][4];
        #pragma unroll
        for (int nb = 0; nb < NT / 8; ++nb) {
            for (int e = 0; e < 4; ++e) s[nb][e] = 0.f;
            const T* krow = ks + (nb * 8 + g) * KP + 2 * t;
            for (int kc = 0; kc < D / 16; ++kc)
                pp_mma<T>(s[nb], qa[kc], *reinterpret_cast<const unsigned*>(krow + kc * 16),
                          *reinterpret_cast<const unsigned*>(krow + kc * 16 + 8));
        }
        float top[2] = {NEG_INF, NEG_INF};
        #pragma unroll
        for (int nb = 0; nb < NT / 8; ++nb)
            for (int e = 0; e < 4; ++e) {
                const int j = k0 + nb * 8 + 2 * t + (e & 1);
                const int i = e >> 1;
                s[nb][e] = (j <= pos[i] && j < k_end) ? s[nb][e] * scale_log2 : NEG_INF;
                top[i] = fmaxf(top[i], s[nb][e]);
            }
        float alpha[2];
        for (int i = 0; i < 2; ++i) {
            top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffff, top[i], 1));
            top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffff, top[i], 2));
            const float m_new = fmaxf(m[i], top[i]);
            // a row that has seen no key of this split yet keeps nothing and adds nothing
            alpha[i] = m_new == NEG_INF ? 1.f : exp2f(m[i] - m_new);
            m[i] = m_new;
            l[i] *= alpha[i];
        }
        const float m_sub[2] = {m[0] == NEG_INF ? 0.f : m[0], m[1] == NEG_INF ? 0.f : m[1]};
        #pragma unroll
        for (int nb = 0; nb < NT / 8; ++nb)
            for (int e = 0; e < 4; ++e) {
                s[nb][e] = exp2f(s[nb][e] - m_sub[e >> 1]);
                l[e >> 1] += s[nb][e];
            }
        for (int db = 0; db < D / 8; ++db) {
            acc[db][0] *= alpha[0];
            acc[db][1] *= alpha[0];
            acc[db][2] *= alpha[1];
            acc[db][3] *= alpha[1];
        }
        #pragma unroll
        for (int kc = 0; kc < NT / 16; ++kc) {
            const unsigned pa[4] = {pp_pack<T>(s[2 * kc][0], s[2 * kc][1]), pp_pack<T>(s[2 * kc][2], s[2 * kc][3]),
                                    pp_pack<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                                    pp_pack<T>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
            for (int db = 0; db < D / 8; ++db) {
                const T* vrow = vt + (db * 8 + g) * VP + kc * 16 + 2 * t;
                pp_mma<T>(acc[db], pa, *reinterpret_cast<const unsigned*>(vrow),
                          *reinterpret_cast<const unsigned*>(vrow + 8));
            }
        }
    }
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffff, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffff, l[i], 2);
        if (!valid[i]) continue;
        EPILOGUE
    }
"""
# One split: the output itself, in the queries' dtype.
_FINAL = """const float inv = 1.f / l[i];
        for (int db = 0; db < D / 8; ++db)
            *reinterpret_cast<unsigned*>(out + row_off[i] + db * 8 + 2 * t) =
                pp_pack<T>(acc[db][2 * i] * inv, acc[db][2 * i + 1] * inv);"""
# Several: each split's unnormalized sums, its maximum in natural-log units and its
# total, for the decode kernel's merge (paged_kernel.py), which reads (rows, H, splits).
_PARTIAL = """const long o = (row_off[i] / D) * n_split + split;
        for (int db = 0; db < D / 8; ++db) {
            out_acc[o * D + db * 8 + 2 * t] = acc[db][2 * i];
            out_acc[o * D + db * 8 + 2 * t + 1] = acc[db][2 * i + 1];
        }
        if (t == 0) {
            out_m[o] = m[i] * 0.6931471805599453f;
            out_l[o] = l[i];
        }"""
_FINAL_SOURCE = _SOURCE.replace("EPILOGUE", _FINAL)
_PARTIAL_SOURCE = _SOURCE.replace("EPILOGUE", _PARTIAL)
_INPUTS = ["q", "k_pool", "v_pool", "block_tables", "seq_rows", "context_lens", "scale"]
_SPLIT_MAX = 16
# Long contexts are split along the keys until a call has about this many thread blocks
# (a few waves of an H100's 132 SMs), each split at least `MIN_SPLIT_KEYS` keys. One
# layer, 1B geometry, H100 (`bench/prefill_plans.py --kernel-splits`), ms unsplit / as
# chosen: one hit over 7,744 keys 0.424 / 0.156 (7 splits), 8 hits 0.624 / 0.521 (4),
# one 128-token chunk over 4,096 0.257 / 0.140 (4); 32 hits over 2,112 stay whole
# (0.45); 8 hits over 2,112 take 2 splits, 0.254 against 0.205 whole in that run.
TARGET_BLOCKS = 792
MIN_SPLIT_KEYS = 1024


def unsupported(heads: int, kv_heads: int, head_dim: int, dtype) -> str | None:
    """Why the kernel cannot serve this geometry, or None."""
    if not available("cuda"):
        return f"not available on {mx.default_device()}"
    if dtype not in DTYPES:
        return f"{dtype} is not a tensor-core input dtype ({', '.join(map(str, DTYPES))})"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {HEAD_DIMS}"
    if heads % kv_heads:
        return f"{heads} heads do not split into {kv_heads} KV-head groups"
    return None


def num_splits(blocks: int, max_context: int) -> int:
    """Splits along the keys for a call of `blocks` thread blocks a split."""
    by_work = -(-TARGET_BLOCKS // max(blocks, 1))
    return max(1, min(by_work, max_context // MIN_SPLIT_KEYS, _SPLIT_MAX))


def _row_tiles(queries: int, heads: int, kv_heads: int) -> int:
    """Thread blocks along a sequence's (query, head) rows of one KV head."""
    return -(-(queries * (heads // kv_heads)) // ROWS)


def group_splits(g: GroupMetadata, heads: int, kv_heads: int) -> int:
    """`num_splits` for a group: its thread blocks are (row tiles, KV heads, sequences)."""
    b, lq = g.query_pos.shape
    return num_splits(_row_tiles(lq, heads, kv_heads) * kv_heads * b, g.max_context_len)


def paged_prefill(q: mx.array, k_pool: mx.array, v_pool: mx.array, g: GroupMetadata,
                  scale: float, block_size: int, splits: int | None = None) -> mx.array:
    """A short prefill group's packed rows q: (Tg, H, 1, D) -> (Tg, H, 1, D), each query
    attending its sequence's keys up to its own position, read from the pool through
    `g.block_tables`; sequence b's rows start at `g.seq_rows[b, 0]`. Long contexts are
    split along the keys (`num_splits`, or `splits`), and the splits merged."""
    h, d = q.shape[1], q.shape[-1]
    b, lq = g.query_pos.shape
    n_kv = k_pool.shape[1]
    tiles = _row_tiles(lq, h, n_kv)
    if splits is None:
        splits = group_splits(g, h, n_kv)
    call = dict(inputs=[q, k_pool, v_pool, g.block_tables, g.seq_rows, g.context_lens, scale_array(scale)],
                template=[("T", q.dtype), ("D", d), ("G", h // n_kv), ("BS", block_size), ("NW", WARPS)],
                grid=(tiles * WARPS * 32, n_kv, b * splits), threadgroup=(WARPS * 32, 1, 1))
    if splits == 1:
        final = kernel("cuda", "paged_prefill_attention", _INPUTS, ["out"], _FINAL_SOURCE, _HEADER)
        return final(**call, output_shapes=[q.shape], output_dtypes=[q.dtype])[0]
    t = q.shape[0]
    partials = kernel("cuda", "paged_prefill_attention_partial", _INPUTS, ["out_acc", "out_m", "out_l"],
                      _PARTIAL_SOURCE, _HEADER)
    acc, m, l = partials(**call, output_shapes=[(t, h, splits, d), (t, h, splits), (t, h, splits)],
                        output_dtypes=[mx.float32] * 3)
    return merge_splits(acc, m, l, q.shape, q.dtype)


def serves(g: GroupMetadata, q: mx.array, k_pool: mx.array, sinks) -> bool:
    """Whether `paged_prefill` takes this group: one CUDA attends `unfused` (short
    chunks), no attention sinks, queries in the pool's dtype."""
    return g.seq_rows is not None and sinks is None and q.dtype == k_pool.dtype


def prefill_problem(lengths: list[int], contexts: list[int], heads: int, kv_heads: int, head_dim: int,
                    block_size: int, dtype, seed: int = 0):
    """A random prefill step over a random pool, as the runner builds it on CUDA (short
    chunks `unfused`): sequence i has `lengths[i]` new tokens at the end of a
    `contexts[i]`-token context (in `sort_key` order). Returns (q, k_pool, v_pool,
    metadata), q the step's packed rows (T, H, 1, D)."""
    rng = np.random.default_rng(seed)
    blocks = [-(-c // block_size) for c in contexts]
    perm = rng.permutation(sum(blocks) + 1)[:sum(blocks)]   # shuffled, some block unused
    tables, at = [], 0
    for n in blocks:
        tables.append(perm[at:at + n].tolist())
        at += n
    shape = ((sum(blocks) + 1) * block_size, kv_heads, head_dim)
    k = mx.array(rng.standard_normal(shape), dtype=dtype)
    v = mx.array(rng.standard_normal(shape), dtype=dtype)
    starts = [c - n for c, n in zip(contexts, lengths)]
    meta = build_metadata(tables, starts, lengths, block_size, plan_per_shape=True)
    q = mx.array(rng.standard_normal((sum(lengths), heads, 1, head_dim)), dtype=dtype)
    return q, k, v, meta
