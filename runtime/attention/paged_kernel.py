"""Fused paged decode attention for MLX's GPU backends: `cuda` (`mx.fast.cuda_kernel`)
and `metal` (`mx.fast.metal_kernel`).

One thread block per (sequence, KV head, split): it reads that head's keys and values
straight from the block pool through the block table, serves every query head of the
GQA group from one load, and keeps an online softmax per group of lanes. A key is read
by a few lanes (8 for head_dim 64), so a warp reads several keys a step: one key a
warp, each lane holding two elements, kept too few loads in flight and reached under
half the copy bandwidth. Long contexts are split
along the sequence (flash-decoding); a second small kernel merges the splits' partial
sums and writes the output in the query's dtype; with one split (a batch big enough to
fill the GPU) the attention kernel writes the output itself. At most two kernels a
layer, because a decode step is host-bound on launches long before it is bound by
bandwidth. Padding costs a sequence nothing here (each reads only its own context), so
a whole decode batch is one group; a sliding-window layer's decodes read their
window's blocks, from the window's first key. Only one-query groups (decodes) use it; short
prefill chunks on CUDA have a kernel of their own (paged_prefill.py), and longer ones
go through `gather`. Attention sinks (gpt-oss) join the softmax where the output is
written.

The kernels are written once, in CUDA C. For Metal, a prologue names CUDA's block and
thread indices after Metal's attributes and a header maps the few CUDA intrinsics used
(shared memory, barrier, warp shuffle, exp) onto Metal's; Apple GPUs run 32-wide SIMD
groups, as CUDA runs 32-wide warps. Metal cannot run on the machines this project is
tested on: the start-up self-check against `gather` (`check_backend`) is that path's
only guard, and a kernel that fails it is not used.
"""

from functools import lru_cache, partial

import mlx.core as mx

from . import gather
from .metadata import GroupMetadata

WARPS = 4
MIN_SPLIT_TOKENS = 256
TARGET_BLOCKS = 264          # about two waves of an H100/H200's 132 SMs

_SOURCE = """
    const int h_kv = blockIdx.y;
    const int n_split = gridDim.z / q_shape[0];
    const int b = blockIdx.z / n_split;
    const int split = blockIdx.z % n_split;
    const int n_heads = q_shape[1];
    const int n_kv = k_pool_shape[1];
    const int n_tab = block_tables_shape[1];
    const int ctx = context_lens[b];
    const int first = FIRST;          // the first key attended: past a sliding window's start
    const int chunk = (ctx - first + n_split - 1) / n_split;
    const int start = first + split * chunk;
    const int end = min(ctx, start + chunk);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    constexpr int V = D / LPT;        // elements of a key each lane holds
    constexpr int TPW = 32 / LPT;     // keys a warp reads per step
    const int sub = lane / LPT;       // which of them this lane reads
    const int part = lane % LPT;      // which V elements of it
    const float NEG_INF = -__int_as_float(0x7f800000);

    float qv[G][V];
    float m[G], l[G], acc[G][V];
    for (int g = 0; g < G; ++g) {
        const long qoff = ((long)b * n_heads + h_kv * G + g) * D + part * V;
        for (int e = 0; e < V; ++e) {
            qv[g][e] = static_cast<float>(q[qoff + e]) * scale[0];
            acc[g][e] = 0.f;
        }
        m[g] = NEG_INF;
        l[g] = 0.f;
    }
    // Every lane runs every step (the shuffles need the whole warp); a lane past the
    // end reads nothing and keeps its state.
    for (int j0 = start + warp * TPW; j0 < end; j0 += NW * TPW) {
        const int j = j0 + sub;
        const bool valid = j < end;
        float kv[V], vv[V];
        if (valid) {
            const int blk = block_tables[b * n_tab + j / BS];
            const long base = ((long)(blk * BS + j % BS) * n_kv + h_kv) * D + part * V;
            for (int e = 0; e < V; ++e) {
                kv[e] = static_cast<float>(k_pool[base + e]);
                vv[e] = static_cast<float>(v_pool[base + e]);
            }
        } else {
            for (int e = 0; e < V; ++e) {
                kv[e] = 0.f;
                vv[e] = 0.f;
            }
        }
        for (int g = 0; g < G; ++g) {
            float s = 0.f;
            for (int e = 0; e < V; ++e) s += qv[g][e] * kv[e];
            for (int off = LPT / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
            if (valid) {
                const float m_new = fmaxf(m[g], s);
                const float corr = __expf(m[g] - m_new);
                const float p = __expf(s - m_new);
                l[g] = l[g] * corr + p;
                for (int e = 0; e < V; ++e) acc[g][e] = acc[g][e] * corr + p * vv[e];
                m[g] = m_new;
            }
        }
    }
    // Merge the warp's TPW partial softmaxes (lanes LPT apart hold the same elements).
    for (int off = LPT; off < 32; off <<= 1) {
        for (int g = 0; g < G; ++g) {
            const float m_o = __shfl_xor_sync(0xffffffff, m[g], off);
            const float l_o = __shfl_xor_sync(0xffffffff, l[g], off);
            const float m_new = fmaxf(m[g], m_o);
            const float c = (m[g] == NEG_INF) ? 0.f : __expf(m[g] - m_new);
            const float c_o = (m_o == NEG_INF) ? 0.f : __expf(m_o - m_new);
            l[g] = l[g] * c + l_o * c_o;
            for (int e = 0; e < V; ++e) {
                const float a_o = __shfl_xor_sync(0xffffffff, acc[g][e], off);
                acc[g][e] = acc[g][e] * c + a_o * c_o;
            }
            m[g] = m_new;
        }
    }

    __shared__ float sm_m[NW][G];
    __shared__ float sm_l[NW][G];
    __shared__ float sm_acc[NW][G][D];
    for (int g = 0; g < G; ++g) {
        if (lane == 0) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
        if (sub == 0) {
            for (int e = 0; e < V; ++e) sm_acc[warp][g][part * V + e] = acc[g][e];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += NW * 32) {
        const int g = idx / D;
        const int d = idx % D;
        float mx_ = NEG_INF;
        for (int w = 0; w < NW; ++w) mx_ = fmaxf(mx_, sm_m[w][g]);
        float lsum = 0.f, a = 0.f;
        for (int w = 0; w < NW; ++w) {
            const float c = (sm_m[w][g] == NEG_INF) ? 0.f : __expf(sm_m[w][g] - mx_);
            lsum += sm_l[w][g] * c;
            a += sm_acc[w][g][d] * c;
        }
        EPILOGUE
    }
"""
# Several splits: each writes its partial sums for the merge kernel.
_PARTIAL = """const long o = ((long)b * n_heads + h_kv * G + g) * n_split + split;
        out_acc[o * D + d] = a;
        if (d == 0) {
            out_m[o] = mx_;
            out_l[o] = lsum;
        }"""
# One split (enough sequences to fill the GPU): the output itself, one kernel a layer.
_FINAL = """out[((long)b * n_heads + h_kv * G + g) * D + d] = static_cast<T>(a / lsum);"""
# An attention sink (gpt-oss): a logit of no value in each head's softmax. Where the
# output is written (one split, or the merge), the sums so far, weighed by their
# maximum `top`, take the sink's share, reweighed by the larger of the two.
_SINK = """{
            const float s_ = static_cast<float>(sinks[HEAD]);
            const float t_ = fmaxf(TOP, s_);
            const float c_ = (TOP == NEG_INF) ? 0.f : __expf(TOP - t_);
            a *= c_;
            lsum = lsum * c_ + __expf(s_ - t_);
        }
        """
_INPUTS = ["q", "k_pool", "v_pool", "block_tables", "context_lens", "scale"]


@lru_cache(maxsize=None)
def _attention(epilogue: str, windowed: bool, sinks: bool = False) -> tuple[str, list[str], str]:
    """(name suffix, inputs, source) of the attention kernel with `epilogue`; `windowed`
    reads each sequence's first key from `key_starts` (a sliding window's start);
    `sinks` (with the one-split epilogue only) adds each head's sink to its softmax.
    Made once per variant: layers call for them every step."""
    suffix, names = "", list(_INPUTS)
    source = _SOURCE.replace("FIRST", "key_starts[b]" if windowed else "0")
    if windowed:
        suffix, names = suffix + "_window", names + ["key_starts"]
    if sinks:
        suffix, names = suffix + "_sinks", names + ["sinks"]
        epilogue = _SINK.replace("HEAD", "h_kv * G + g").replace("TOP", "mx_") + epilogue
    return suffix, names, source.replace("EPILOGUE", epilogue)


_MERGE_SOURCE = """
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const int S = out_m_shape[2];
    const int D = out_acc_shape[3];
    if (i >= (long)out_acc_shape[0] * out_acc_shape[1] * D) return;
    const long bh = i / D;
    const int d = i % D;
    const float NEG_INF = -__int_as_float(0x7f800000);
    float top = NEG_INF;
    for (int s = 0; s < S; ++s) top = fmaxf(top, out_m[bh * S + s]);
    float lsum = 0.f, a = 0.f;
    for (int s = 0; s < S; ++s) {
        const float mv = out_m[bh * S + s];
        const float c = (mv == NEG_INF) ? 0.f : __expf(mv - top);
        lsum += out_l[bh * S + s] * c;
        a += out_acc[(bh * S + s) * D + d] * c;
    }
    SINK
    out[i] = static_cast<T>(a / lsum);
"""
MERGE_THREADS = 256

# CUDA names the Metal prologue and header define; a test checks the kernels use no other.
_METAL_PROLOGUE = """
    const uint3 blockIdx = threadgroup_position_in_grid;
    const uint3 threadIdx = thread_position_in_threadgroup;
    const uint3 gridDim = threadgroups_per_grid;
    const uint3 blockDim = threads_per_threadgroup;
"""
_METAL_HEADER = """
#define __shared__ threadgroup
#define __syncthreads() threadgroup_barrier(metal::mem_flags::mem_threadgroup)
#define __shfl_xor_sync(mask, value, lane_mask) metal::simd_shuffle_xor(value, lane_mask)
#define __expf(x) metal::precise::exp(x)
#define __int_as_float(x) as_type<float>(x)
#define fmaxf(a, b) metal::fmax(a, b)
"""
_kernels: dict[tuple[str, str], object] = {}
_scales: dict[float, mx.array] = {}


def unsupported(heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the kernel cannot serve this geometry, or None; `resolve_backend` then
    refuses the kernel for the model."""
    if head_dim % 32 or head_dim > 256:
        return f"head_dim {head_dim} is not a multiple of 32 up to 256"
    if heads % kv_heads:
        return f"{heads} heads do not split into {kv_heads} KV-head groups"
    return None


def kernel(dialect: str, name: str, inputs: list[str], outputs: list[str], source: str, header: str = ""):
    """The custom kernel `name` in `dialect` ("cuda" or "metal"), made once a process;
    `header`: code before the kernel's body (helper functions)."""
    k = _kernels.get((dialect, name))
    if k is None:
        if dialect == "cuda":
            k = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=source,
                                    header=header)
        else:
            k = mx.fast.metal_kernel(name=name, input_names=inputs, output_names=outputs,
                                     source=_METAL_PROLOGUE + source, header=_METAL_HEADER + header)
        _kernels[(dialect, name)] = k
    return k


def scale_array(scale: float) -> mx.array:
    """One device scalar per softmax scale, made once rather than every layer call."""
    a = _scales.get(scale)
    if a is None:
        a = _scales[scale] = mx.array([scale], dtype=mx.float32)
    return a


def lanes_per_key(head_dim: int) -> int:
    """Lanes sharing one key: the fewest (a power of two) that leave each at most 8
    elements, so a warp reads several keys per step and each lane keeps up to 16 loads
    in flight rather than 2."""
    n = 1
    while head_dim // n > 8 or head_dim % n:
        n *= 2
    return n


def num_splits(batch: int, kv_heads: int, max_context: int) -> int:
    by_work = -(-TARGET_BLOCKS // (batch * kv_heads))
    by_length = max(1, max_context // MIN_SPLIT_TOKENS)
    return max(1, min(by_work, by_length, 32))


def paged_decode(q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array,
                 context_lens: mx.array, max_context: int, scale: float, block_size: int,
                 dialect: str = "cuda", key_starts: mx.array | None = None,
                 sinks: mx.array | None = None) -> mx.array:
    """q: (B, H, D), or (B, H, 1, D) as the model's layers hand it over -> the same shape.
    The kernels index only its first two axes and its elements: the singleton axis
    costs no squeeze before nor expand after, each a primitive MLX would queue per layer.
    `key_starts` (B,): each sequence attends keys [key_starts, context_lens) of its
    table (a sliding window's); all from the first without it. `sinks` (H,): each
    head's sink logit, as `mx.fast.scaled_dot_product_attention` takes them."""
    b, h, d = q.shape[0], q.shape[1], q.shape[-1]
    n_kv = k_pool.shape[1]
    if (why := unsupported(h, n_kv, d)) is not None:
        raise ValueError(f"paged_decode: {why}")
    splits = num_splits(b, n_kv, max_context)
    inputs = [q, k_pool, v_pool, block_tables, context_lens, scale_array(scale)]
    windowed = key_starts is not None
    call = dict(inputs=inputs + [key_starts] if windowed else inputs,
                grid=(WARPS * 32, n_kv, b * splits), threadgroup=(WARPS * 32, 1, 1))
    template = [("D", d), ("G", h // n_kv), ("BS", block_size), ("NW", WARPS), ("LPT", lanes_per_key(d))]
    if splits == 1:
        suffix, names, source = _attention(_FINAL, windowed, sinks is not None)
        final = kernel(dialect, "paged_decode_attention_final" + suffix, names, ["out"], source)
        if sinks is not None:
            call["inputs"] = call["inputs"] + [sinks]
        return final(**call, template=template + [("T", q.dtype)],
                     output_shapes=[q.shape], output_dtypes=[q.dtype])[0]
    suffix, names, source = _attention(_PARTIAL, windowed)
    acc, m, l = kernel(dialect, "paged_decode_attention" + suffix, names, ["out_acc", "out_m", "out_l"],
                        source)(
        **call, template=template,
        output_shapes=[(b, h, splits, d), (b, h, splits), (b, h, splits)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    return merge_splits(acc, m, l, q.shape, q.dtype, dialect, sinks)


def merge_splits(acc: mx.array, m: mx.array, l: mx.array, shape, dtype, dialect: str = "cuda",
                 sinks: mx.array | None = None) -> mx.array:
    """Partial softmax sums of (rows, H, splits) -> the attention output, (rows, H, ...D)
    as `shape`: each split's sums weighed by its maximum (natural-log units, -inf for a
    split that saw no key) against the rows' overall one; `sinks` (H,) join the softmax."""
    total = acc.shape[0] * acc.shape[1] * acc.shape[3]
    name, names, source = _merge(sinks is not None)
    return kernel(dialect, name, names, ["out"], source)(
        inputs=[acc, m, l] + ([sinks] if sinks is not None else []),
        template=[("T", dtype)],
        grid=(-(-total // MERGE_THREADS) * MERGE_THREADS, 1, 1),
        threadgroup=(MERGE_THREADS, 1, 1),
        output_shapes=[shape],
        output_dtypes=[dtype],
    )[0]


@lru_cache(maxsize=None)
def _merge(sinks: bool) -> tuple[str, list[str], str]:
    """(name, inputs, source) of the merge kernel, with each head's sink or without."""
    if sinks:
        return ("paged_decode_merge_sinks", ["out_acc", "out_m", "out_l", "sinks"],
                _MERGE_SOURCE.replace("SINK", _SINK.replace("HEAD", "bh % out_acc_shape[1]").replace("TOP", "top")))
    return "paged_decode_merge", ["out_acc", "out_m", "out_l"], _MERGE_SOURCE.replace("SINK", "")


def attend_group(dialect: str, q: mx.array, k_pool: mx.array, v_pool: mx.array, g: GroupMetadata,
                 scale: float, block_size: int, sinks: mx.array | None = None,
                 window: int | None = None) -> mx.array:
    """The `cuda` and `metal` backends: the fused kernel for decode groups (with their
    layer's attention sinks, if any), `gather` for the rest (prefill chunks). A
    sliding-window layer's decodes read their window's blocks in place
    (`GroupMetadata.windowed_decode`)."""
    if not g.single_query:
        return gather.attend_group(q, k_pool, v_pool, g, scale, block_size, sinks, window)
    if window is None:
        return paged_decode(q, k_pool, v_pool, g.block_tables, g.context_lens, g.max_context_len, scale,
                            block_size, dialect, sinks=sinks)
    tables, lens, starts, longest = g.windowed_decode(window, block_size)
    return paged_decode(q, k_pool, v_pool, tables, lens, longest, scale, block_size, dialect, starts, sinks)


attend_cuda = partial(attend_group, "cuda")
attend_metal = partial(attend_group, "metal")
