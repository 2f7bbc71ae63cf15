"""Prefill attention alone: gather's call with the boolean mask against the additive one
it now hands SDPA, and SDPA without a mask as a floor.

Each case is one prefill group as the runner builds it (`make_group`, padded to
power-of-two shapes on CUDA): `batch` sequences, each `queries` new tokens at the end of
a `context`-token context in the block pool. Per case: the whole `gather.attend_group`
call, the gather of K/V alone (as `gather_kv` does it on this device, and by MLX
indexing, the portable way), and SDPA over the gathered K/V with the boolean mask,
the additive mask, and none. Times are medians of back-to-back calls.

    python bench/prefill_mask.py                                  # CPU-sized
    python bench/prefill_mask.py --heads 32 --kv-heads 8 \\
        --cases 8x84x2116 1x84x2116 4x84x2116 8x2116x2116 1x2116x2116 16x512x512   # 1B shape, GPU
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench.paged_attention import parse_geometry_args, write_results  # noqa: E402
from runtime.attention import gather  # noqa: E402
from runtime.attention.metadata import flatten, make_group  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def prefill_cases(args) -> tuple[list[tuple[int, int, int]], mx.array, mx.array]:
    """`--cases` as (batch, queries, context), and random K and V pools that hold them."""
    cases = [tuple(map(int, c.split("x"))) for c in args.cases]
    slots = max(b * -(-ctx // args.block_size) for b, _, ctx in cases) * args.block_size
    shape = (slots, args.kv_heads, args.head_dim)
    k_pool, v_pool = (mx.random.normal(shape).astype(getattr(mx, args.dtype)) for _ in range(2))
    mx.eval(k_pool, v_pool)
    return cases, k_pool, v_pool


def run_case(batch: int, queries: int, context: int, pad: bool, k_pool, v_pool, args) -> dict:
    bs, dtype = args.block_size, k_pool.dtype
    per = -(-context // bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    g = make_group(*flatten(tables), [context - queries] * batch, [queries] * batch,
                   np.full(batch, context), 0, bs, plan_per_shape=pad, unfused_max_queries=0)
    b, lq = g.query_pos.shape
    q = mx.random.normal((b, args.heads, lq, args.head_dim)).astype(dtype)
    scale = args.head_dim ** -0.5
    k = mx.contiguous(gather.gather_kv(k_pool, g.block_tables, bs))
    v = mx.contiguous(gather.gather_kv(v_pool, g.block_tables, bs))
    additive = g.additive_mask(dtype)
    mx.eval(q, k, v, additive, g.mask)

    def sdpa(mask):
        return lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    def gather_only(fn=gather.gather_kv):
        return lambda: [mx.contiguous(fn(p, g.block_tables, bs)) for p in (k_pool, v_pool)]

    r = {"batch": batch, "queries": queries, "context": context, "padded": pad,
         "shape": [b, lq, int(g.block_tables.shape[1]) * bs],
         "attend_group_ms": median_ms(lambda: gather.attend_group(q, k_pool, v_pool, g, scale, bs), args.repeats),
         "gather_ms": median_ms(gather_only(), args.repeats),
         "gather_indexing_ms": median_ms(gather_only(gather.gather_by_indexing), args.repeats),
         "sdpa_bool_mask_ms": median_ms(sdpa(g.mask), args.repeats),
         "sdpa_additive_mask_ms": median_ms(sdpa(additive), args.repeats),
         "sdpa_no_mask_ms": median_ms(sdpa(None), args.repeats)}
    r["bool_over_additive"] = r["sdpa_bool_mask_ms"] / r["sdpa_additive_mask_ms"]
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["4x32x256", "1x256x256"],
                    help="BATCHxQUERIESxCONTEXT, each run padded (as on CUDA) and not")
    ap.add_argument("--repeats", type=int, default=20)
    args, out = parse_geometry_args(ap, argv, "prefill_mask")
    cases, k_pool, v_pool = prefill_cases(args)
    rows = [run_case(b, lq, ctx, pad, k_pool, v_pool, args) for b, lq, ctx in cases for pad in (True, False)]
    print(f"{args.heads} heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, {args.dtype}, "
          f"{mx.default_device()}; ms per call (one layer)")
    print(f"{'case':>14} | {'padded to':>16} | {'attend':>7} | {'gather':>7} | {'by index':>8} | {'bool':>7} | "
          f"{'additive':>8} | {'none':>7} | bool/additive")
    for r in rows:
        case = f"{r['batch']}x{r['queries']}x{r['context']}"
        print(f"{case:>14} | {'x'.join(map(str, r['shape'])) if r['padded'] else '-':>16} | "
              f"{r['attend_group_ms']:7.3f} | {r['gather_ms']:7.3f} | {r['gather_indexing_ms']:8.3f} | "
              f"{r['sdpa_bool_mask_ms']:7.3f} | "
              f"{r['sdpa_additive_mask_ms']:8.3f} | {r['sdpa_no_mask_ms']:7.3f} | {r['bool_over_additive']:.2f}x")
    write_results(out, args, rows)


if __name__ == "__main__":
    main()
