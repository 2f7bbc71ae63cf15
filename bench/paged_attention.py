"""Decode attention alone, per backend: the time of one layer's call over a paged pool,
and the K/V bytes it reads per second against the device's copy bandwidth.

Each backend this device has runs the same random decode groups (`gather` everywhere;
the fused `cuda` or `metal` kernel on those GPUs). A call's output is the next call's
query, so a chain of calls runs back to back as in a model's layers; the time is the
median chain over its length. Contexts are ragged, spread up to `--context` as
`check_backend` makes them.

    python bench/paged_attention.py                               # CPU-sized
    python bench/paged_attention.py --batch 1 32 128 256 --context 576 2048 \
        --heads 32 --kv-heads 8 --head-dim 64                     # the 1B shape, on a GPU
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.bench_continuous_vs_static import RESULTS, copy_bandwidth  # noqa: E402
from runtime.attention import BACKENDS, KERNELS, available, decode_problem  # noqa: E402


def median_call_s(call, q: mx.array, chain: int, repeats: int) -> float:
    """Seconds a call of `call(x) -> x` takes, as the median over `repeats` chains of
    `chain` calls, each call's output the next one's query, as in a model's layers."""
    def run():
        x = q
        for _ in range(chain):
            x = call(x)
        return x

    mx.eval(run())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(run())
        times.append((time.perf_counter() - t) / chain)
    return statistics.median(times)


def time_backend(name: str, batch: int, context: int, args) -> dict:
    dtype = getattr(mx, args.dtype)
    q, k, v, g = decode_problem(batch, context, args.heads, args.kv_heads, args.head_dim,
                                args.block_size, dtype)
    fn, scale = BACKENDS[name], args.head_dim ** -0.5
    per_call = median_call_s(lambda x: fn(x, k, v, g, scale, args.block_size), q, args.chain, args.repeats)
    keys = int(mx.sum(g.context_lens).item())
    kv_bytes = 2 * keys * args.kv_heads * args.head_dim * dtype.size
    return {"backend": name, "batch": batch, "context": context, "us_per_call": per_call * 1e6,
            "kv_bytes": kv_bytes, "kv_bytes_per_s": kv_bytes / per_call}


def write_results(out: Path, args: argparse.Namespace, rows: list[dict], **meta) -> None:
    """`{"meta": ..., "rows": rows}` to `out`; meta has the device, MLX and the arguments."""
    meta = {"device": str(mx.default_device()), "mlx": mx.__version__, **meta,
            **{k: v for k, v in vars(args).items() if k != "out"}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


def parse_geometry_args(ap: argparse.ArgumentParser, argv, name: str) -> tuple[argparse.Namespace, Path]:
    """Adds the options the attention benchmarks share (geometry, dtype, output) and
    parses. Returns the arguments, with the dtype resolved for this device, and the
    JSON path: `--out`, else bench/results/{name}_{cpu,gpu}.json."""
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--out", default=None, help=f"default: bench/results/{name}_{{cpu,gpu}}.json")
    args = ap.parse_args(argv)
    gpu = mx.default_device() == mx.gpu
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    return args, Path(args.out or RESULTS / f"{name}_{'gpu' if gpu else 'cpu'}.json")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    args, out = parse_geometry_args(ap, argv, "paged_attention")
    backends = ["gather"] + [n for n in KERNELS if available(n)]
    bandwidth = copy_bandwidth()
    rows = []
    for context in args.context:
        for batch in args.batch:
            for name in backends:
                r = time_backend(name, batch, context, args)
                r["fraction_of_copy_bandwidth"] = r["kv_bytes_per_s"] / bandwidth
                rows.append(r)
    base = {(r["batch"], r["context"]): r["us_per_call"] for r in rows if r["backend"] == "gather"}
    for r in rows:
        r["speedup_vs_gather"] = base[(r["batch"], r["context"])] / r["us_per_call"]
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; {args.heads} heads, {args.kv_heads} KV heads, "
          f"head_dim {args.head_dim}, {args.dtype}, block {args.block_size}")
    print(f"{'context':>7} | {'batch':>5} | {'backend':>7} | {'us/call':>9} | {'GB/s':>8} | {'of copy bw':>10} | vs gather")
    for r in rows:
        print(f"{r['context']:7d} | {r['batch']:5d} | {r['backend']:>7} | {r['us_per_call']:9.1f} | "
              f"{r['kv_bytes_per_s'] / 1e9:8.1f} | {r['fraction_of_copy_bandwidth']:10.1%} | "
              f"{r['speedup_vs_gather']:.2f}x")
    write_results(out, args, rows, copy_bandwidth_bytes_s=bandwidth)


if __name__ == "__main__":
    main()
