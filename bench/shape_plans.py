"""What a new shape costs a matmul: the first call at a shape against calls at shapes seen.

MLX's matmuls on CUDA choose a plan for each new shape; on Metal and the CPU nothing
is kept per shape. A serving step's packed rows number whatever its sequences' new
tokens add up to, so an engine that ran steps at their own sizes met new shapes in
every matmul of nearly every step with prompt tokens. For each projection width this
times `--count` row counts drawn from `--rows`, each called for the first time, then
the same again; and unfused attention (two matmuls and a softmax, as a prefix hit's
group runs on CUDA) at as many new (sequences, queries, keys) shapes. It also counts
the shapes left when row counts are padded to the engine's grid (`padded_rows`) and
the rows that padding wastes. Writes `bench/results/shape_plans_<tag>.json`.

    python bench/shape_plans.py --tag gpu
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.bench_continuous_vs_static import RESULTS, run_meta, write_result  # noqa: E402
from runtime.attention.metadata import padded_rows  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - t) * 1e3


def matmul_ms(m: int, w: mx.array) -> float:
    x = mx.random.normal((m, w.shape[1])).astype(w.dtype)
    mx.eval(x)
    return timed(lambda: x @ w.T)


def attention_ms(b: int, lq: int, keys: int, heads: int, kv_heads: int, head_dim: int, dtype) -> float:
    """Unfused GQA attention as `runtime.attention.gather.attend_unfused` computes it."""
    q = mx.random.normal((b, kv_heads, heads // kv_heads * lq, head_dim)).astype(dtype)
    k = mx.random.normal((b, kv_heads, keys, head_dim)).astype(dtype)
    mx.eval(q, k)
    return timed(lambda: mx.softmax(q @ k.swapaxes(-1, -2), axis=-1, precise=True) @ k)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--out-dims", type=int, nargs="+", default=[3072, 8192],
                    help="projection widths (Llama-3.2-1B: fused q/k/v 3,072; the MLP 8,192)")
    ap.add_argument("--rows", type=int, nargs=2, default=[64, 1024], help="row counts drawn from this range")
    ap.add_argument("--count", type=int, default=40)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--results-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    rng = random.Random(0)
    lo, hi = args.rows
    ms = rng.sample(range(lo, hi + 1), min(args.count, hi - lo + 1))
    grid = sorted({padded_rows(m) for m in range(lo, hi + 1)})
    waste = max((padded_rows(m) - m) / m for m in range(lo, hi + 1))
    rows = []
    for n in args.out_dims:
        w = mx.random.normal((n, args.hidden)).astype(dtype)
        mx.eval(w)
        matmul_ms(lo, w)   # the first call of all, apart
        first = [matmul_ms(m, w) for m in ms]
        again = [matmul_ms(m, w) for m in ms]
        rows.append({"op": f"matmul {args.hidden}->{n}", "new_shape_ms_p50": statistics.median(first),
                     "seen_shape_ms_p50": statistics.median(again)})
    shapes = [(rng.randint(1, 8), rng.randint(32, 96), 16 * rng.randint(128, 140))   # 16-token blocks
              for _ in range(args.count)]
    att = [args.heads, args.kv_heads, args.head_dim, dtype]
    attention_ms(4, 64, 2112, *att)
    first = [attention_ms(*s, *att) for s in shapes]
    again = [attention_ms(*s, *att) for s in shapes]
    rows.append({"op": "unfused attention", "new_shape_ms_p50": statistics.median(first),
                 "seen_shape_ms_p50": statistics.median(again)})
    print(f"{mx.default_device()}: {len(ms)} new row counts in [{lo}, {hi}]; the grid holds {len(grid)} sizes "
          f"there, wasting at most {waste:.1%} of a step's rows")
    print(f"{'op':>24} | {'new shape ms p50':>16} | {'seen shape ms p50':>17}")
    for r in rows:
        print(f"{r['op']:>24} | {r['new_shape_ms_p50']:>16.3f} | {r['seen_shape_ms_p50']:>17.3f}")
    out = {**run_meta(argparse.Namespace(**{**vars(args), "model": None})), "grid_sizes": len(grid),
           "grid_waste_max": waste, "rows": rows}
    write_result(args.results_dir, f"shape_plans_{args.tag}.json", out)


if __name__ == "__main__":
    main()
