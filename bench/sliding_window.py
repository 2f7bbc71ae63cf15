"""A sliding-window layer's decode attention: reading only its window's blocks against
reading the whole context with the window in the mask, and against a full layer.

A sliding-window layer (Gemma 3, gpt-oss) attends each query's last W keys. `gather`
reads, for such a layer, the blocks from each sequence's window start on
(`GroupMetadata.windowed`); the way before read every block of the context and masked
all but the window. Both run here on the same random decode groups (contexts ragged up
to `--context`, as `check_backend` makes them), with a full-attention call beside them;
the windowed ways must agree. On a GPU the fused decode kernel's way runs beside them:
it reads the window's blocks in place, from each sequence's first key in its window
(`GroupMetadata.windowed_decode`). The time is the median of a chain of calls, each
call's output the next one's query, as in a model's layers.

    python bench/sliding_window.py                                   # CPU-sized
    python bench/sliding_window.py --window 128 --context 1024 8192 \\
        --heads 64 --kv-heads 8 --head-dim 64 --sinks                # gpt-oss's shape, on a GPU
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.paged_attention import median_call_s, parse_geometry_args, write_results  # noqa: E402
from runtime.attention import KERNELS, available, decode_problem, gather, paged_kernel  # noqa: E402


def masked_whole_context(q, k_pool, v_pool, g, scale, block_size, window, sinks=None):
    """The way before: every block of the context, the window in the mask."""
    k = gather.gather_kv(k_pool, g.block_tables, block_size)
    v = gather.gather_kv(v_pool, g.block_tables, block_size)
    keys = mx.arange(g.mask.shape[-1])
    allowed = g.mask & (keys > g.query_pos[:, None, :, None] - window)
    mask = mx.where(allowed, mx.array(0, q.dtype), mx.array(mx.finfo(q.dtype).min, q.dtype))
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def ways(window: int, sinks=None):
    """Each way's call; with `sinks` (H,), every way adds the heads' sinks to its softmax."""
    fns = {
        "full layer": lambda q, k, v, g, s, bs: gather.attend_group(q, k, v, g, s, bs, sinks),
        "window, whole context read": lambda q, k, v, g, s, bs: masked_whole_context(q, k, v, g, s, bs, window,
                                                                                     sinks),
        "window, its blocks read": lambda q, k, v, g, s, bs: gather.attend_group(q, k, v, g, s, bs, sinks,
                                                                                 window=window),
    }
    for dialect in (d for d in KERNELS if available(d)):
        fns["full layer, decode kernel"] = lambda q, k, v, g, s, bs, d=dialect: paged_kernel.attend_group(
            d, q, k, v, g, s, bs, sinks)
        fns["window, decode kernel"] = lambda q, k, v, g, s, bs, d=dialect: paged_kernel.attend_group(
            d, q, k, v, g, s, bs, sinks, window=window)
    return fns


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sinks", action="store_true", help="attention sinks in every layer, as gpt-oss's")
    args, out = parse_geometry_args(ap, argv, "sliding_window")
    dtype = getattr(mx, args.dtype)
    scale = args.head_dim ** -0.5
    rows = []
    for context in args.context:
        for batch in args.batch:
            q, k, v, g = decode_problem(batch, context, args.heads, args.kv_heads, args.head_dim,
                                        args.block_size, dtype)
            sinks = mx.random.normal((args.heads,), key=mx.random.key(0)).astype(dtype) if args.sinks else None
            fns = ways(args.window, sinks)
            old = fns["window, whole context read"](q, k, v, g, scale, args.block_size).astype(mx.float32)
            diff = max(float(mx.abs(old - fn(q, k, v, g, scale, args.block_size).astype(mx.float32)).max().item())
                       for name, fn in fns.items() if name.startswith("window") and name != "window, whole context read")
            times = {name: median_call_s(lambda x, fn=fn: fn(x, k, v, g, scale, args.block_size), q, args.chain,
                                         args.repeats) for name, fn in fns.items()}
            base = times["window, whole context read"]
            for name, t in times.items():
                rows.append({"way": name, "batch": batch, "context": context, "window": args.window,
                             "sinks": args.sinks,
                             "us_per_call": t * 1e6, "speedup_vs_whole_context": base / t,
                             "max_abs_diff_windowed_ways": diff})
    print(f"window {args.window}{', attention sinks' if args.sinks else ''}; {args.heads} heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
          f"{args.dtype}, block {args.block_size}; {mx.default_device()}")
    print(f"{'context':>7} | {'batch':>5} | {'way':>26} | {'us/call':>9} | vs whole context read")
    for r in rows:
        print(f"{r['context']:7d} | {r['batch']:5d} | {r['way']:>26} | {r['us_per_call']:9.1f} | "
              f"{r['speedup_vs_whole_context']:.2f}x")
    print(f"largest difference between the windowed ways: {max(r['max_abs_diff_windowed_ways'] for r in rows):.2e}")
    write_results(out, args, rows)


if __name__ == "__main__":
    main()
