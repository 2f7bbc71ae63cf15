"""Prefill attention where MLX's fused attention builds a plan per input shape (CUDA):
fused SDPA on padded shapes (`PAD_STEPS` sizes an octave, and, as `fused-pow2`, powers
of two), against two matmuls and a softmax (padded to a finer grid since d9b676d: the
matmuls plan per shape too), and on CUDA against the fused short-prefill kernel that
now takes those groups (`kernel`, paged_prefill.py).

Each case is one prefill group as the runner builds it (`build_metadata`): `batch`
sequences, each `queries` new tokens at the end of a `context`-token context in the
block pool, through `paged_attention` with `gather` (which the CUDA kernel backend
uses for prefill too). Per case and way, the first call (for `fused`, the plan build of
a shape this process has not met yet) and the median of back-to-back calls; `chosen`
is the way the runner takes (`UNFUSED_MAX_QUERIES`). On a device without per-shape
plans, fused runs unpadded and its first call builds nothing.

    python bench/prefill_plans.py                                   # CPU-sized
    python bench/prefill_plans.py --heads 32 --kv-heads 8 --cases 1x64x2112 2x64x2112 \\
        4x64x2112 8x64x2112 8x16x2112 8x32x2112 8x128x2112 8x256x2112 8x512x2112 \\
        1x256x2112 8x64x8192 32x64x2112 64x64x1024 1x1024x4096 4x2112x2112   # 1B shape, GPU
"""

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.paged_attention import parse_geometry_args, write_results  # noqa: E402
from bench.prefill_mask import prefill_cases  # noqa: E402
from runtime.attention import available, build_metadata, gather, metadata, paged_attention, paged_prefill  # noqa: E402

# (`unfused_max_queries`, `pad_steps`) that force each way; `kernel` is the unfused
# groups through the fused short-prefill kernel (paged_prefill.py, CUDA only)
WAYS = {"fused": (0, None), "fused-pow2": (0, 1), "unfused": (1 << 30, None), "kernel": (1 << 30, None)}


def timed(fn, repeats: int) -> tuple[float, float]:
    """(first call, median of the next `repeats`) in ms."""
    t = time.perf_counter()
    mx.eval(fn())
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return first * 1e3, statistics.median(times) * 1e3


def run_case(batch: int, queries: int, context: int, k_pool, v_pool, args) -> dict:
    bs, dtype = args.block_size, k_pool.dtype
    per = -(-context // bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    starts, lengths = [context - queries] * batch, [queries] * batch
    q = mx.random.normal((batch * queries, args.heads, 1, args.head_dim)).astype(dtype)
    scale = args.head_dim ** -0.5
    plans = available("cuda")
    chosen = "unfused" if plans and 1 < queries <= metadata.UNFUSED_MAX_QUERIES else "fused"
    r = {"batch": batch, "queries": queries, "context": context, "chosen": chosen}
    outs = {}
    kernel = paged_prefill.unsupported(args.heads, args.kv_heads, args.head_dim, dtype) is None
    ways = {**WAYS, **{f"kernel-s{n}": WAYS["kernel"] for n in args.kernel_splits}}
    for way, (limit, steps) in ways.items():
        if (way == "fused-pow2" and not plans) or (way.startswith("kernel") and not (kernel and 1 < queries)):
            continue   # nothing is padded; no kernel here, or a decode
        meta = build_metadata(tables, starts, lengths, bs, plan_per_shape=plans or way in ("unfused", "kernel"),
                              unfused_max_queries=limit, pad_steps=steps)
        (g,) = meta.groups
        r[f"{way}_shape"] = [*g.query_pos.shape, int(g.block_tables.shape[1]) * bs]
        if way == "kernel":
            r["kernel_splits"] = paged_prefill.group_splits(g, args.heads, args.kv_heads)
        prefill = None
        if way.startswith("kernel"):
            prefill = partial(paged_prefill.paged_prefill, splits=int(way[8:]) if way != "kernel" else None)
        fn = lambda: paged_attention(q, k_pool, v_pool, meta, scale, gather.attend_group, prefill=prefill)  # noqa: E731
        r[f"{way}_first_ms"], r[f"{way}_ms"] = timed(fn, args.repeats)
        outs[way] = fn().astype(mx.float32)
    r["max_abs_diff"] = max(float(mx.abs(outs["unfused"] - o).max().item()) for o in outs.values())
    r["unfused_over_fused"] = r["unfused_ms"] / r["fused_ms"]
    if "fused-pow2" in outs:
        r["pow2_over_fused"] = r["fused-pow2_ms"] / r["fused_ms"]
    if "kernel" in outs:
        r["kernel_over_unfused"] = r["kernel_ms"] / r["unfused_ms"]
        r["kernel_over_fused"] = r["kernel_ms"] / r["fused_ms"]
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["2x16x256", "4x32x256", "1x64x512"],
                    help="BATCHxQUERIESxCONTEXT")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--kernel-splits", type=int, nargs="*", default=[],
                    help="also time the prefill kernel at these fixed splits along the keys")
    args, out = parse_geometry_args(ap, argv, "prefill_plans")
    cases, k_pool, v_pool = prefill_cases(args)
    rows = [run_case(b, lq, ctx, k_pool, v_pool, args) for b, lq, ctx in cases]
    print(f"{args.heads} heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, {args.dtype}, "
          f"{mx.default_device()}; ms per call (one layer)")
    print(f"{'case':>14} | {'fused shape':>16} | {'fused first':>11} | {'fused':>7} | {'pow2 shape':>16} | "
          f"{'pow2 first':>10} | {'pow2':>7} | {'unfused first':>13} | {'unfused':>7} | {'unf/fused':>9} | "
          f"chosen  | max diff | {'kernel':>7} | {'krn/unf':>7} | {'krn/fused':>9}")
    for r in rows:
        case = f"{r['batch']}x{r['queries']}x{r['context']}"
        pow2 = ("x".join(map(str, r["fused-pow2_shape"])), f"{r['fused-pow2_first_ms']:.2f}",
                f"{r['fused-pow2_ms']:.3f}") if "fused-pow2_ms" in r else ("-", "-", "-")
        print(f"{case:>14} | {'x'.join(map(str, r['fused_shape'])):>16} | {r['fused_first_ms']:11.2f} | "
              f"{r['fused_ms']:7.3f} | {pow2[0]:>16} | {pow2[1]:>10} | {pow2[2]:>7} | "
              f"{r['unfused_first_ms']:13.2f} | {r['unfused_ms']:7.3f} | {r['unfused_over_fused']:9.2f} | "
              f"{r['chosen']:7} | {r['max_abs_diff']:8.2g} | "
              + (f"{r['kernel_ms']:7.3f} | {r['kernel_over_unfused']:7.2f} | {r['kernel_over_fused']:9.2f}"
                 if "kernel_ms" in r else f"{'-':>7} | {'-':>7} | {'-':>9}"))
    for r in rows:
        fixed = [n for n in args.kernel_splits if f"kernel-s{n}_ms" in r]
        if fixed:
            print(f"{r['batch']}x{r['queries']}x{r['context']}: kernel {r['kernel_ms']:.3f} ms "
                  f"({r['kernel_splits']} splits); " + ", ".join(f"{n} splits {r[f'kernel-s{n}_ms']:.3f}" for n in fixed))
    write_results(out, args, rows, unfused_max_queries=metadata.UNFUSED_MAX_QUERIES,
                  pad_steps=metadata.PAD_STEPS)


if __name__ == "__main__":
    main()
