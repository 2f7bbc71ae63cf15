"""What bounding MLX's buffer cache costs: the same closed loop of requests on one
engine, with MLX's own cache limit (its memory limit on Metal and CUDA), the engine's
default bound (`bound_buffer_cache`) and smaller ones, alternating round after round.

Freed device buffers stay in MLX's cache for reuse. At hundreds of sequences, steps of
ever-changing shapes leave buffers of every size there, and unbounded the cache grows to
several times the KV pool. A bound returns the excess to the device, and each row says
what that costs in throughput and what it saves in memory: the most bytes the cache
held, and the most the process held in all (live arrays plus cache), sampled after every
step.

In-process, one `LLMEngine`; every run has the same prompt and output lengths, with fresh
random tokens so that no run hits the prefix cache of another. Writes
`bench/results/buffer_cache_<tag>.json`.

    python bench/buffer_cache.py                                   # CPU, embedded model
    python bench/buffer_cache.py --model llama-1b --tag gpu --streams 256 --requests 768 \\
        --prompt-len 512 --gen-len 128 --kv-cache-gb 16 --limits-gb mlx default 4 1 --rounds 3
"""

import argparse
import json
import random
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import (RESULTS, resolve_model, run_meta, run_ours, workload,  # noqa: E402
                                              write_result)

from runtime import EngineConfig, LLMEngine  # noqa: E402


def fresh_tokens(reqs, vocab: int, seed: int):
    """The same lengths, new tokens."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in p], g) for p, g in reqs]


def run_once(engine: LLMEngine, reqs, streams: int, limit: int, label: str) -> dict:
    mx.clear_cache()
    mx.set_cache_limit(limit)
    most = {"cache": 0, "total": 0}

    def sample():
        cache = mx.get_cache_memory()
        most["cache"] = max(most["cache"], cache)
        most["total"] = max(most["total"], cache + mx.get_active_memory())

    row = run_ours(engine, reqs, streams, label, on_step=sample)
    row.update(limit=label, cache_limit_bytes=limit, cache_bytes_max=most["cache"],
               held_bytes_max=most["total"], kv_pool_bytes=engine.runner.pool.nbytes)
    return row


def limit_bytes(name: str, mlx_default: int, engine_default: int) -> int:
    if name == "mlx":
        return mlx_default
    if name == "default":
        return engine_default
    return int(float(name) * 2**30)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default', 'llama-1b' (random, bf16) or a path")
    ap.add_argument("--tag", default="cpu", help="results go to buffer_cache_<tag>.json")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=128, help="mean; each prompt 1/4 to 7/4 of it")
    ap.add_argument("--gen-len", type=int, default=64, help="mean; each output 1/4 to 7/4 of it")
    ap.add_argument("--kv-cache-gb", type=float, default=0.5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--limits-gb", nargs="+", default=["mlx", "default", "0.25"],
                    help="'mlx' (MLX's own limit), 'default' (the engine's bound) or GiB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--results-dir", default=str(RESULTS))
    args = ap.parse_args(argv)

    mlx_default = mx.set_cache_limit(0)
    mx.set_cache_limit(mlx_default)
    model = resolve_model(args.model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    extra = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=args.streams,
                                    kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30), **extra))
    engine_default = engine.buffer_cache_limit
    shape = workload(args.requests, argparse.Namespace(fixed=False, prompt_len=args.prompt_len,
                                                       gen_len=args.gen_len), vocab, seed=0)
    run_once(engine, fresh_tokens(shape[:args.streams], vocab, 10**6), args.streams, mlx_default, "warm-up")

    runs: list[dict] = []
    seed = 1
    for r in range(args.rounds):
        order = args.limits_gb if r % 2 == 0 else args.limits_gb[::-1]
        for name in order:
            row = run_once(engine, fresh_tokens(shape, vocab, seed), args.streams,
                           limit_bytes(name, mlx_default, engine_default), name)
            row["round"] = r
            seed += 1
            runs.append(row)
            print(f"round {r} {name:>8}: {row['output_tok_s']:9.1f} tok/s, cache max "
                  f"{row['cache_bytes_max'] / 2**30:6.2f} GiB, held max {row['held_bytes_max'] / 2**30:6.2f} GiB",
                  flush=True)
    engine.close()
    mx.set_cache_limit(mlx_default)

    rows = []
    base = float(np.median([x["output_tok_s"] for x in runs if x["limit"] == args.limits_gb[0]]))
    for name in args.limits_gb:
        mine = [x for x in runs if x["limit"] == name]
        tok_s = float(np.median([x["output_tok_s"] for x in mine]))
        rows.append({"limit": name, "cache_limit_bytes": mine[0]["cache_limit_bytes"],
                     "output_tok_s": tok_s, f"vs_{args.limits_gb[0]}": tok_s / base,
                     "runs_output_tok_s": [x["output_tok_s"] for x in mine],
                     "ttft_p50_s": float(np.median([x["ttft_p50_s"] for x in mine])),
                     "cache_bytes_max": max(x["cache_bytes_max"] for x in mine),
                     "held_bytes_max": max(x["held_bytes_max"] for x in mine),
                     "kv_pool_bytes": mine[0]["kv_pool_bytes"]})
    print(f"\n{args.requests} requests, {args.streams} streams, KV pool "
          f"{rows[0]['kv_pool_bytes'] / 2**30:.2f} GiB; medians of {args.rounds} rounds")
    print(f"  {'limit':>8} {'GiB':>8} {'tok/s':>9} {'ratio':>6} {'cache max GiB':>14} {'held max GiB':>13}")
    for x in rows:
        print(f"  {x['limit']:>8} {x['cache_limit_bytes'] / 2**30:8.2f} {x['output_tok_s']:9.1f} "
              f"{x[f'vs_{args.limits_gb[0]}']:6.3f} {x['cache_bytes_max'] / 2**30:14.2f} "
              f"{x['held_bytes_max'] / 2**30:13.2f}")
    meta = run_meta(args)
    meta.update(mlx_cache_limit_bytes=mlx_default, engine_default_bytes=engine_default)
    write_result(args.results_dir, f"buffer_cache_{args.tag}.json", {"meta": meta, "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
