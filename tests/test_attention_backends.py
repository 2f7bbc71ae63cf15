"""Attention backends: `auto` selection, and the fused CUDA kernel against `gather`.

The CUDA tests run only where MLX's CUDA backend is the default device (the GPU
machine); on CPU and Metal they skip with that reason.
"""

import functools

import mlx.core as mx
import numpy as np
import pytest

from runtime import EngineConfig, LLMEngine, SamplingParams
from runtime.attention import build_metadata, check_backend, gather, paged_attention, prefill_fn, resolve_backend, sort_key
from runtime.attention import available, metadata, paged_kernel, paged_prefill
from runtime.attention import decode_problem

from .conftest import reference_greedy

needs_cuda = pytest.mark.skipif(not available("cuda"),
                                reason="needs MLX's CUDA backend as the default device")


def test_auto_falls_back_to_gather_without_a_kernel():
    if available("cuda") or available("metal"):
        pytest.skip("a GPU kernel backend is present; auto may pick the kernel here")
    name, why = resolve_backend("auto", 8, 2, 64, 16, mx.float32)
    assert name == "gather" and "cuda: not available" in why and "metal: not available" in why
    for kernel in ("cuda", "metal"):
        with pytest.raises(ValueError, match="not available"):
            resolve_backend(kernel, 8, 2, 64, 16, mx.float32)


def test_metal_source_maps_every_cuda_name_the_kernels_use():
    """The Metal kernels are the CUDA source under a prologue and a header of macros.
    Metal is not run here, so this at least holds the translation complete: every
    CUDA-only name in the kernels is one the prologue or header defines."""
    import re

    cuda_only = {"blockIdx", "threadIdx", "gridDim", "blockDim", "warpSize", "fmaxf", "fminf", "expf",
                 "logf", "sqrtf", "rsqrtf", "atomicAdd"}
    used = set()
    sources = [paged_kernel._attention(e, w, sk)[2] for e in (paged_kernel._PARTIAL, paged_kernel._FINAL)
               for w in (False, True) for sk in (False, True)]
    sources += [paged_kernel._MERGE_SOURCE, paged_kernel._SINK]
    for src in sources:
        used |= {w for w in re.findall(r"[A-Za-z_]\w*", src) if w.startswith("__") or w in cuda_only}
    defined = set(re.findall(r"#define (\w+)", paged_kernel._METAL_HEADER))
    defined |= set(re.findall(r"const uint3 (\w+) =", paged_kernel._METAL_PROLOGUE))
    assert used and used <= defined, sorted(used - defined)


def test_a_kernel_that_cannot_serve_the_model_is_refused_or_skipped():
    """The CUDA kernel needs head_dim % 32 == 0: configured, that is an error; under
    `auto`, gather serves the model (here on any device)."""
    assert "multiple of 32" in paged_kernel.unsupported(4, 2, 16)
    assert paged_kernel.unsupported(32, 8, 64) is None
    with pytest.raises(ValueError, match="cannot serve this model"):
        resolve_backend("cuda", 4, 2, 16, 16, mx.float32)
    name, why = resolve_backend("auto", 4, 2, 16, 16, mx.float32)
    assert name == "gather" and "cuda:" in why


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("flash9", 8, 2, 64, 16, mx.float32)


# One split (the attention kernel writes the output) and several (partial sums, merged).
CUDA_CASES = [(1, 1, 8, 8, 64), (3, 33, 8, 2, 64), (40, 300, 32, 8, 64), (7, 700, 32, 8, 64),
              (64, 3000, 16, 4, 128), (2, 9000, 4, 1, 64)]


def test_kernel_cases_cover_one_and_several_splits():
    splits = {paged_kernel.num_splits(b, kv, ctx) for b, ctx, _, kv, _ in CUDA_CASES}
    assert 1 in splits and len(splits) > 2


@needs_cuda
@pytest.mark.parametrize("dtype, tol", [(mx.float32, 2e-3), (mx.bfloat16, 3e-2)])
@pytest.mark.parametrize("batch, context, heads, kv_heads, head_dim", CUDA_CASES)
def test_cuda_kernel_matches_gather(dtype, tol, batch, context, heads, kv_heads, head_dim):
    q, k, v, g = decode_problem(batch, context, heads, kv_heads, head_dim, 16, dtype, seed=batch)
    scale = head_dim ** -0.5
    want = gather.attend_group(q, k, v, g, scale, 16).astype(mx.float32)
    got = paged_kernel.attend_cuda(q, k, v, g, scale, 16).astype(mx.float32)
    assert float(mx.abs(got - want).max().item()) <= tol


@needs_cuda
@pytest.mark.parametrize("dtype, kv_heads, head_dim", [(mx.bfloat16, 8, 64), (mx.float32, 2, 32),
                                                       (mx.float16, 4, 128)])
def test_cuda_block_gather_matches_indexing(dtype, kv_heads, head_dim):
    """On CUDA `gather_kv` copies blocks with a kernel of its own: the same K/V as MLX's
    indexing, for repeated, padded (block 0) and shuffled block tables."""
    rng = np.random.default_rng(4)
    pool = mx.array(rng.standard_normal((50 * 16, kv_heads, head_dim)), dtype=dtype)
    tables = mx.array(np.concatenate([rng.permutation(50)[:24], [0] * 8, [7] * 8]).reshape(5, 8).astype(np.int32))
    got = gather.gather_kv(pool, tables, 16)
    want = gather.gather_by_indexing(pool, tables, 16)
    assert got.shape == want.shape == (5, kv_heads, 128, head_dim)
    assert mx.array_equal(got, want).item()


@needs_cuda
@pytest.mark.parametrize("window, sinks", [(None, False), (100, False), (128, True)])
def test_cuda_self_check_passes(window, sinks):
    ok, why = check_backend("cuda", 32, 8, 64, 16, mx.bfloat16, window=window, sinks=sinks)
    assert "differs" not in why and "failed" not in why, why


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("batch, context", [(3, 40), (5, 3000), (64, 600)])
@pytest.mark.parametrize("window", [None, 1, 100])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_the_decode_kernel_with_windows_and_sinks_matches_gather(batch, context, window, with_sinks, dtype):
    """The decode kernel's variants against `gather`: a sliding window's start as each
    sequence's first key, attention sinks where the output is written, in one split
    (short contexts, many sequences) and across several (3,000-token contexts, merged),
    gpt-oss's sinks of either sign."""
    heads, kv_heads, d, bs = 16, 4, 64, 16
    q, k, v, g = decode_problem(batch, context, heads, kv_heads, d, bs, dtype, seed=batch)
    sinks = mx.array(np.linspace(-4, 4, heads), dtype=dtype) if with_sinks else None
    want = gather.attend_group(q, k, v, g, d ** -0.5, bs, sinks, window=window).astype(mx.float32)
    got = paged_kernel.attend_cuda(q, k, v, g, d ** -0.5, bs, sinks, window=window).astype(mx.float32)
    assert float(mx.abs(got - want).max().item()) < (2e-3 if dtype == mx.float32 else 3e-2)


@needs_cuda
def test_engine_on_cuda_backend_matches_mlx_lm(default_model):
    engine = LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=64, attention_backend="cuda"))
    prompts = [[5, 6, 7], list(range(10, 60)), [9] * 17]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == [t for t, _ in reference_greedy(engine.config.model, p, 10)]


# (lengths, contexts, heads, kv_heads, head_dim, block_size): a hit wave, ragged hits over
# ragged contexts, whole short prompts, one query head a KV head, a group of 7, head_dim
# 128, blocks of 32, a context that ends mid-tile.
PREFILL_CASES = [([64] * 8, [2112] * 8, 32, 8, 64, 16), ([64, 37, 5], [2112, 1500, 1100], 32, 8, 64, 16),
                 ([100, 17], [100, 60], 8, 8, 64, 16), ([2, 2], [70, 64], 28, 4, 128, 16),
                 ([128, 90], [4000, 3000], 16, 2, 128, 32), ([33], [1000], 32, 8, 64, 16)]


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("lengths, contexts, heads, kv_heads, head_dim, block_size", PREFILL_CASES)
def test_cuda_prefill_kernel_matches_gather(dtype, lengths, contexts, heads, kv_heads, head_dim, block_size):
    q, k, v, meta = paged_prefill.prefill_problem(lengths, contexts, heads, kv_heads, head_dim, block_size,
                                                  dtype, seed=len(lengths))
    assert all(g.unfused for g in meta.groups)   # the groups the kernel takes over
    scale = head_dim ** -0.5
    want = paged_attention(q, k, v, meta, scale, gather.attend_group).astype(mx.float32)
    got = paged_attention(q, k, v, meta, scale, gather.attend_group,
                          prefill=paged_prefill.paged_prefill).astype(mx.float32)
    assert float(mx.abs(got - want).max().item()) <= 3e-2


@needs_cuda
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_cuda_prefill_kernel_split_along_the_keys_matches_gather(splits):
    """Long contexts are split along the keys and merged: any number of splits, some of
    them empty for the shorter contexts, gives what gather gives."""
    q, k, v, meta = paged_prefill.prefill_problem([64, 37, 5], [2112, 1500, 1100], 32, 8, 64, 16,
                                                  mx.bfloat16, seed=splits)
    scale = 64 ** -0.5
    want = paged_attention(q, k, v, meta, scale, gather.attend_group).astype(mx.float32)
    kernel = functools.partial(paged_prefill.paged_prefill, splits=splits)
    got = paged_attention(q, k, v, meta, scale, gather.attend_group, prefill=kernel).astype(mx.float32)
    assert float(mx.abs(got - want).max().item()) <= 3e-2


def test_long_prefill_contexts_split_along_the_keys():
    """Splits where a call has too few thread blocks to fill the GPU, each at least
    `MIN_SPLIT_KEYS` keys, at most 16."""
    assert paged_prefill.num_splits(2, 500) == 1
    assert paged_prefill.num_splits(paged_prefill.TARGET_BLOCKS, 100_000) == 1
    assert paged_prefill.num_splits(16, 3 * paged_prefill.MIN_SPLIT_KEYS) == 3
    assert paged_prefill.num_splits(1, 10**6) == 16


def test_prefill_groups_say_where_each_sequence_rows_start():
    """The prefill kernel finds a sequence's rows through `seq_rows`: its first row in
    the group and its count; padding sequences have none. Only short (unfused) groups
    carry it."""
    meta = build_metadata([[0, 1], [2, 3], [4]], [20, 14, 13], [5, 3, 2], 16, plan_per_shape=True)
    (g,) = meta.groups
    assert g.unfused and g.seq_rows.tolist() == [[0, 5], [5, 3], [8, 2], [0, 0]]
    long = build_metadata([[0] * 20], [0], [300], 16, plan_per_shape=True).groups[0]
    assert not long.unfused and long.seq_rows is None


@needs_cuda
def test_cuda_prefill_self_check_passes_and_serves_the_cuda_backend():
    fn, why = prefill_fn("cuda", 32, 8, 64, 16, mx.bfloat16)
    assert fn is paged_prefill.paged_prefill, why
    fn, why = prefill_fn("cuda", 32, 8, 64, 16, mx.float32)
    assert fn is None and "float32" in why
    assert prefill_fn("gather", 32, 8, 64, 16, mx.bfloat16)[0] is None


@needs_cuda
def test_engine_prefix_hits_through_the_prefill_kernel_match_mlx_lm(tmp_path):
    """A bfloat16 model of head_dim 64, so prefix-cache hits and short prompts go through
    the prefill kernel: the same greedy tokens as mlx-lm, first a whole prompt, then
    three hits on its prefix with new suffixes of 1 to 40 tokens."""
    from runtime.models.tiny import make_model

    path = str(make_model(tmp_path / "m", hidden=256, layers=2, heads=4, kv_heads=2, vocab_size=384,
                          seed=5, dtype="bfloat16"))
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=256, attention_backend="cuda"))
    assert engine.runner.ctx.prefill_fn is paged_prefill.paged_prefill
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 380, 200).tolist()
    prompts = [prefix + rng.integers(3, 380, n).tolist() for n in (5, 1, 40, 17)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for p in prompts:
        (out,) = engine.generate([p], params)
        assert out.outputs[0].token_ids == [t for t, _ in reference_greedy(path, p, 6)]
    assert engine.stats()["prefix_cache_hit_tokens"] >= 3 * 192
    off = LLMEngine(EngineConfig(model=path, num_gpu_blocks=256, attention_backend="cuda", prefill_kernel=False))
    assert off.runner.ctx.prefill_fn is None


@needs_cuda
def test_sliding_window_layers_beside_the_kernels_match_mlx_lm(tmp_path):
    """Gemma 3's shape on the `cuda` backend: its full-attention layer through the fused
    kernels (decode and prefix-hit prefill), its sliding-window layers (window 32)
    reading their windows' blocks, decodes through the decode kernel and prefill chunks
    through `gather`; mlx-lm's greedy tokens for prompts
    many windows long, then prefix hits on one of them, one request at a time as the
    bfloat16 test above runs them."""
    from runtime.models.tiny import make_model

    path = str(make_model(tmp_path / "g", arch="gemma3_text", hidden=256, layers=3, heads=4, kv_heads=2,
                          vocab_size=384, seed=6, dtype="bfloat16", sliding_window=32))
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=256, attention_backend="cuda"))
    assert [c.window for c in engine.runner.caches] == [32, None, 32]
    assert engine.runner.ctx.prefill_fn is paged_prefill.paged_prefill
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 380, n).tolist() for n in (7, 150, 300)]
    prompts += [prompts[2] + rng.integers(3, 380, n).tolist() for n in (1, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for p in prompts:
        (out,) = engine.generate([p], params)
        assert out.outputs[0].token_ids == [t for t, _ in reference_greedy(path, p, 6)]
    assert engine.stats()["prefix_cache_hit_tokens"] >= 2 * 288


def _windowed_reference(q, k_pool, v_pool, tables, starts, lengths, block_size, scale, window, sinks=None):
    """Each token row's attention over its sequence's last `window` keys up to its own,
    one row at a time from the pool's slots (with `sinks`, each head's sink logit joins
    the softmax)."""
    heads, kv_heads = q.shape[1], k_pool.shape[1]
    out, row = [], 0
    for table, start, n in zip(tables, starts, lengths):
        for p in range(start, start + n):
            pos = np.arange(max(0, p - window + 1), p + 1)
            slots = mx.array(np.asarray(table)[pos // block_size] * block_size + pos % block_size)
            k, v = k_pool[slots], v_pool[slots]                               # (S, Hkv, D)
            kh = mx.repeat(k, heads // kv_heads, axis=1).transpose(1, 0, 2)   # (H, S, D)
            vh = mx.repeat(v, heads // kv_heads, axis=1).transpose(1, 0, 2)
            scores = (q[row, :, 0, None, :] @ kh.swapaxes(1, 2)) * scale                  # (H, 1, S)
            if sinks is not None:
                scores = mx.concatenate([sinks[:, None, None], scores], axis=-1)
            w = mx.softmax(scores, axis=-1)
            out.append(((w[..., 1:] if sinks is not None else w) @ vh)[:, 0])
            row += 1
    return mx.stack(out)[:, :, None]


def _decode_view(q, k_pool, v_pool, g, scale, block_size, sinks=None, window=None):
    """What the fused decode kernels compute for a sliding-window layer's decodes, in
    MLX ops: each sequence's keys [first, lens) of its view (`windowed_decode`), with
    the layer's sinks if any; any other group through `gather`, as the kernels'
    backends send it."""
    if not g.single_query or window is None:
        return gather.attend_group(q, k_pool, v_pool, g, scale, block_size, sinks, window)
    tables, lens, first, longest = g.windowed_decode(window, block_size)
    assert longest <= tables.shape[1] * block_size
    k, v = gather.gather_kv(k_pool, tables, block_size), gather.gather_kv(v_pool, tables, block_size)
    keys = mx.arange(tables.shape[1] * block_size)[None]
    allowed = (keys >= first[:, None]) & (keys < lens[:, None])
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=allowed[:, None, None, :], sinks=sinks)


@pytest.mark.parametrize("through", ["gather", "kernel view", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("plan_per_shape, split_decodes", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("window", [1, 5, 16, 40, 1000])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_sliding_window_layer_reads_its_window_and_matches_attention_over_it(window, plan_per_shape,
                                                                               split_decodes, with_sinks,
                                                                               through):
    """A sliding-window layer's attention, which reads only the blocks of each
    sequence's window (`GroupMetadata.windowed`, and for a fused kernel's decodes
    `windowed_decode`), against attention over each token's last `window` keys
    computed one row at a time: decodes of long and short contexts, prefix-hit chunks
    and a whole prompt, in groups padded for per-shape plans (padding queries and
    sequences included) or not, decodes of all lengths in one group (as a fused
    kernel's backend groups them) or not, windows inside a block and past the context;
    with attention sinks (gpt-oss's) or without. Through `gather`, through the decode
    kernels' view in MLX ops, and on CUDA through the kernels."""
    rng = np.random.default_rng(window)
    bs, heads, kv_heads, d = 8, 4, 2, 32
    seqs = [(300, 1), (97, 1), (6, 1), (0, 1), (150, 20), (61, 3), (0, 45), (50, 30)]   # (start, new tokens)
    seqs.sort(key=lambda sn: sort_key(sn[1], sn[0] + sn[1]))
    starts, lengths = [st for st, _ in seqs], [n for _, n in seqs]
    perm, tables, at = rng.permutation(200), [], 0
    for st, n in seqs:
        need = -(-(st + n) // bs)
        tables.append(perm[at:at + need].tolist())
        at += need
    k_pool = mx.array(rng.standard_normal((200 * bs, kv_heads, d)), dtype=mx.float32)
    v_pool = mx.array(rng.standard_normal((200 * bs, kv_heads, d)), dtype=mx.float32)
    q = mx.array(rng.standard_normal((sum(lengths), heads, 1, d)), dtype=mx.float32)
    meta = build_metadata(tables, starts, lengths, bs, split_decodes=split_decodes, plan_per_shape=plan_per_shape,
                          unfused_max_queries=20)
    assert (meta.groups[0].block_tables.shape[0] == 4) == (not split_decodes)
    assert any(g.unfused for g in meta.groups) == plan_per_shape
    assert any(g.out_rows is not None and g.block_tables.shape[0] == 4 for g in meta.groups) == plan_per_shape
    sinks = mx.array(rng.standard_normal(heads), dtype=mx.float32) if with_sinks else None
    attend = {"gather": gather.attend_group, "kernel view": _decode_view, "cuda": paged_kernel.attend_cuda}[through]
    got = paged_attention(q, k_pool, v_pool, meta, d ** -0.5, attend, sinks, window=window)
    want = _windowed_reference(q, k_pool, v_pool, tables, starts, lengths, bs, d ** -0.5, window, sinks)
    assert float(mx.abs(got - want).max().item()) < 1e-4
    if window < 40:   # the long decode reads its window's blocks, not its 38-block context
        assert meta.groups[0].windowed(window, bs, mx.float32)[0].shape[1] <= -(-window // bs) + 1
        assert meta.groups[0].windowed_decode(window, bs)[0].shape[1] <= -(-window // bs) + 1


def test_decode_groups_split_by_length_only_for_padding_backends():
    """gather pads a group to its longest context, so decodes of very different lengths
    go to separate groups; a fused kernel reads each context in place, so they stay one
    group (one launch a layer). Prefill chunks are grouped by length either way."""
    tables = [list(range(i * 8, i * 8 + n)) for i, n in enumerate([8, 1, 6, 1])]
    starts, lengths = [120, 3, 60, 10], [1, 1, 30, 5]
    split = build_metadata(tables, starts, lengths, 16)
    whole = build_metadata(tables, starts, lengths, 16, split_decodes=False)
    assert [(g.row_start, g.row_end) for g in split.groups] == [(0, 1), (1, 2), (2, 32), (32, 37)]
    assert [(g.row_start, g.row_end) for g in whole.groups] == [(0, 2), (2, 32), (32, 37)]
    assert whole.groups[0].context_lens.tolist() == [121, 4]
    assert split.slot_mapping.tolist() == whole.slot_mapping.tolist()


def test_prefill_groups_are_padded_to_few_shapes():
    """Fused attention plans per shape (on CUDA, up to a second for each new one), so a
    long prefill group's sequences, queries and key blocks are padded, here (under
    `FINE_PAD_QUERIES`) to powers of two, and the real rows map back in packed order.
    (The limit is lowered so that a small group counts as long.)"""
    tables = [[3, 4], [7]]
    meta = build_metadata(tables, [10, 6], [5, 3], 16, plan_per_shape=True, unfused_max_queries=4)
    assert not meta.groups[0].unfused
    (g,) = meta.groups
    assert g.block_tables.shape == (2, 4) and g.query_pos.shape == (2, 16)
    assert g.mask.shape == (2, 1, 16, 64)
    assert g.query_rows[0, :5].tolist() == [0, 1, 2, 3, 4] and g.query_rows[1, :3].tolist() == [5, 6, 7]
    assert g.out_rows.tolist() == [0, 1, 2, 3, 4, 16, 17, 18]
    assert g.query_pos[0, :5].tolist() == [10, 11, 12, 13, 14] and g.query_pos[0, 5:].tolist() == [0] * 11
    assert meta.slot_mapping.tolist() == [4 * 16 + p - 16 for p in range(10, 15)] + [7 * 16 + p for p in range(6, 9)]


def test_short_prefill_groups_go_unfused_on_a_grid_where_shapes_cost_plans():
    """Under per-shape plans, a group of up to UNFUSED_MAX_QUERIES queries a sequence
    is attended unfused, padded to its grid (sequences to a power of two, queries to
    `PAD_STEPS` sizes an octave, key blocks to `ROW_PAD_STEPS`): its matmuls plan per
    shape too. Past that it is padded and fused. Without per-shape plans neither
    happens."""
    limit = metadata.UNFUSED_MAX_QUERIES
    tables, starts = [list(range(20)), list(range(20, 40))], [150, 140]
    (short,) = build_metadata(tables, starts, [limit, 3], 16, plan_per_shape=True).groups
    assert short.unfused and short.query_pos.shape == (2, limit) and short.block_tables.shape == (2, 20)
    ragged = build_metadata(tables + [list(range(40, 61))], starts + [200], [limit - 5, 3, 70], 16,
                            plan_per_shape=True).groups
    (g,) = [g for g in ragged if g.unfused]
    assert g.query_pos.shape == (4, limit) and g.block_tables.shape == (4, 22)
    out = g.out_rows.tolist()   # each sequence's rows from the start of its padded row
    assert len(out) == limit - 5 + 3 + 70 and out[limit - 5] == limit and out[limit - 2] == 2 * limit
    (long_,) = build_metadata(tables, starts, [limit + 1, limit + 1], 16, plan_per_shape=True).groups
    assert not long_.unfused and long_.query_pos.shape == (2, 2 * limit) and long_.block_tables.shape == (2, 32)
    (plain,) = build_metadata(tables, starts, [limit, 3], 16).groups
    assert not plain.unfused and plain.query_pos.shape == (2, limit)
    decode = build_metadata(tables, starts, [1, 1], 16, plan_per_shape=True).groups
    assert not any(g.unfused for g in decode)


def test_long_prefill_is_padded_to_finer_sizes():
    """`padded_size` keeps `steps` sizes an octave: each size is at least `n` and wastes
    under 1/steps of it, and steps 1 is the power of two. Past `FINE_PAD_QUERIES`,
    three 4,160-token prompts attend as 3 x 5,120 queries over 5,120 keys, not (powers
    of two) 4 x 8,192 over 8,192: 5.2x their own attention work became 1.5x. Up to it,
    groups keep powers of two."""
    for steps in (1, 2, 4, 8):
        sizes = {metadata.padded_size(n, 1, steps) for n in range(1, 4097)}
        assert len({s for s in sizes if 2048 < s <= 4096}) == steps
        for n in range(1, 4097):
            p = metadata.padded_size(n, 1, steps)
            assert n <= p and (p - n) * steps < max(n, steps)
    assert [metadata.padded_size(n, 1, 1) for n in (1, 3, 4160, 8192)] == [1, 4, 8192, 8192]
    assert metadata.padded_size(5, 16, 4) == 16
    tables = [list(range(i * 260, (i + 1) * 260)) for i in range(3)]
    (g,) = build_metadata(tables, [0] * 3, [4160] * 3, 16, plan_per_shape=True).groups
    assert g.query_pos.shape == (3, 5120) and g.block_tables.shape == (3, 320)
    (p2,) = build_metadata(tables, [0] * 3, [4160] * 3, 16, plan_per_shape=True, pad_steps=1).groups
    assert p2.query_pos.shape == (4, 8192) and p2.block_tables.shape == (4, 512)
    n = metadata.FINE_PAD_QUERIES
    (short,) = build_metadata([t[:n // 16] for t in tables], [0] * 3, [n] * 3, 16, plan_per_shape=True).groups
    assert short.query_pos.shape == (4, n) and short.block_tables.shape == (4, n // 16)


def test_row_grid_is_fine_where_compute_counts():
    """A step's rows pad to `ROW_PAD_STEPS` sizes an octave, in steps of at most
    `ROW_PAD_MAX_STEP`: under an eighth wasted, under 1 % at 16k rows, and a bounded
    number of shapes for MLX's matmuls to plan."""
    sizes = {metadata.padded_rows(n) for n in range(1, 16385)}
    assert 150 < len(sizes) < 200 and min(sizes) == 16
    for n in range(1, 16385):
        p = metadata.padded_rows(n)
        assert n <= p and (p - n) * metadata.ROW_PAD_STEPS < max(n, 16 * metadata.ROW_PAD_STEPS)
        assert p - n < metadata.ROW_PAD_MAX_STEP
    assert metadata.padded_rows(16000) - 16000 < 0.01 * 16000 and metadata.padded_rows(5, 8) == 8


@pytest.mark.parametrize("plan_per_shape", [False, True])
def test_prefix_hits_are_not_padded_to_a_new_prompt_beside_them(plan_per_shape):
    """Prefill sequences are grouped by their number of new tokens as well as by
    context: hits (a few new tokens over a cached prefix) and a whole prompt of about
    the same context, in `sort_key` order, make two groups, and the hits' group is as
    wide in queries as its longest hit (under per-shape plans: unfused, on its grid).
    Decodes and chunks within a class still share a group."""
    hits = [(2100, 84), (2090, 64), (2080, 100)]        # (first new position, new tokens)
    seqs = hits + [(0, 2112), (2000, 1), (1500, 1)]
    seqs.sort(key=lambda s: sort_key(s[1], s[0] + s[1]))
    assert [n for _, n in seqs] == [1, 1, 2112, 84, 100, 64]
    starts, lengths = [s for s, _ in seqs], [n for _, n in seqs]
    tables = [list(range(i * 140, i * 140 + -(-(s + n) // 16))) for i, (s, n) in enumerate(seqs)]
    groups = build_metadata(tables, starts, lengths, 16, split_decodes=False, plan_per_shape=plan_per_shape).groups
    assert [(g.row_start, g.row_end) for g in groups] == [(0, 2), (2, 2114), (2114, 2362)]
    # Under per-shape plans the unfused group sits on its grid: 4 sequences, 112 queries.
    assert groups[2].query_pos.shape == ((4, 112) if plan_per_shape else (3, 100))
    assert groups[2].unfused == plan_per_shape
    assert not groups[1].unfused
    assert [metadata.query_class(n) for n in (1, 64, 128, 129, 256, 257)] == [7, 7, 7, 8, 8, 9]


@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-5), (mx.bfloat16, 2e-2), (mx.float16, 2e-3)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_unfused_prefill_matches_fused(dtype, tol, heads, kv_heads):
    """The unfused way (matmuls, float32 softmax) gives fused SDPA's output on ragged
    prefill groups: sequences of different lengths and contexts, GQA, padding queries."""
    rng = np.random.default_rng(1)
    bs, d = 16, 32
    k_pool, v_pool = (mx.array(rng.standard_normal((64 * bs, kv_heads, d)), dtype=dtype) for _ in range(2))
    tables = [[5, 9, 2, 40], [7, 8, 12], [11, 3]]
    starts, lengths = [40, 33, 26], [9, 14, 2]
    fused, unfused = (build_metadata(tables, starts, lengths, bs, plan_per_shape=p).groups for p in (False, True))
    assert [g.unfused for g in unfused] == [True] and [g.unfused for g in fused] == [False]
    (gf,), (gu,) = fused, unfused
    b, lq = gf.query_pos.shape
    assert gu.query_pos.shape == (4, 16)   # padded to its grid
    q = mx.array(rng.standard_normal((4, heads, 16, d)), dtype=dtype)
    want = gather.attend_group(q[:b, :, :lq], k_pool, v_pool, gf, d ** -0.5, bs).astype(mx.float32)
    got = gather.attend_group(q, k_pool, v_pool, gu, d ** -0.5, bs).astype(mx.float32)[:b, :, :lq]
    valid = (np.arange(lq)[None] < np.asarray(lengths)[:, None])[:, None, :, None]
    err = mx.abs(got - want) * mx.array(valid)
    assert float(err.max().item()) <= tol


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_additive_mask_attends_as_the_boolean_one(dtype):
    """gather hands SDPA the mask as 0 / lowest value in the query's dtype (CUDA's fused
    attention runs boolean masks several times slower): the outputs match the boolean
    mask's, and the mask is made once per group and dtype, shared by every layer."""
    tables = [[3, 4], [7]]
    (g,) = build_metadata(tables, [10, 6], [5, 3], 16, plan_per_shape=True, unfused_max_queries=0).groups
    add = g.additive_mask(dtype)
    assert add is g.additive_mask(dtype) and add.dtype == dtype and add.shape == g.mask.shape
    assert mx.array_equal(add == 0, g.mask)
    grouped = g.additive_mask(dtype, grouped=True)   # per KV head and query head, for the unfused way
    assert grouped is g.additive_mask(dtype, grouped=True) and mx.array_equal(grouped[:, :, 0], add)
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((2, 4, 16, 8)), dtype=dtype)
    k, v = (mx.array(rng.standard_normal((2, 2, 64, 8)), dtype=dtype) for _ in range(2))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=g.mask).astype(mx.float32)
    got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=add).astype(mx.float32)
    assert mx.allclose(got, want, atol=1e-2 if dtype != mx.float32 else 1e-5).item()


@pytest.mark.parametrize("compile_decode", [False, True])
def test_decode_steps_write_the_pool_in_place(default_model, compile_decode):
    """KV writes update the pool in place. A step queued while the previous one still
    held the pool would copy each layer's whole pool array instead (MLX donates a
    buffer only when nothing queued holds it): device memory would peak a layer
    array above what is live. The pool is large (a layer array is 256 MiB) so that
    a copy stands well clear of a step's transient buffers (tens of MiB on CUDA)."""
    engine = LLMEngine(EngineConfig(model=default_model, num_gpu_blocks=65536, max_num_seqs=16,
                                    compile_decode=compile_decode))
    layer_bytes = engine.runner.pool.keys[0].nbytes
    for i in range(16):
        engine.add_request(f"r{i}", None, SamplingParams(max_tokens=64, ignore_eos=True),
                           prompt_token_ids=[3 + (5 * i + j) % 200 for j in range(64)])
    for _ in range(8):
        engine.step()
    mx.synchronize()
    mx.reset_peak_memory()
    live = mx.get_active_memory()
    for _ in range(24):
        engine.step()
    mx.synchronize()
    assert mx.get_peak_memory() - live < layer_bytes // 2
    while engine.has_unfinished_requests():
        engine.step()
