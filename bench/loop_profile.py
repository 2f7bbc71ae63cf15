"""A prefix hit's time to first token through the engine's serving loop, beside the
engine stepped directly.

`hit_profile.py` steps an `LLMEngine` itself and adds a request the moment another
finishes. A server drives the same engine through `AsyncEngine`: its `EngineLoop`, on a
thread or in an engine process of its own, takes commands between steps, paces outputs
and sends each turn's events back. This runs one workload (hit_profile's prefix
workload, hits only) through each `--driver`:

- `step`: hit_profile's own loop;
- `thread`, `process`: `AsyncEngine`, `--streams` asyncio tasks each sending its next
  request when the last one finished (closed loop), paced as the app paces its streams.

Per driver: TTFT p50 from the caller's side (`add_request`, or `generate()` called,
until the first token is in hand) and, through `AsyncEngine`, its parts
(`RequestMetrics.ttft_parts`). With `thread` the loop's steps are timed as in
hit_profile, and so is the loop's own time between them ("between"), with the
sequences with prompt tokens each step carried ("prefills").

What the HTTP benchmarks' requests do differently can be asked for: `--ban-eos` (EOS
kept out through `logit_bias` rather than `ignore_eos`), `--jitter` (ragged suffixes) and
`--in-step` (streams started together with equal lengths, finishing in the same steps).

    python bench/loop_profile.py --model llama-1b --prefix-len 2048 --suffix-len 64 --streams 8
"""

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import RESULTS, resolve_model, run_meta, write_result  # noqa: E402
from bench.hit_profile import run_pass, workload_args  # noqa: E402
from bench.step_clock import PARTS, StepClock  # noqa: E402

from runtime import AsyncEngine, EngineConfig, LLMEngine, SamplingParams  # noqa: E402

PART_NAMES = ("to_engine", "engine_queue", "engine_prefill", "from_engine", "to_caller")


def engine_config(args) -> EngineConfig:
    return EngineConfig(model=resolve_model(args.model), max_num_seqs=max(args.streams, 8),
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30))


def prefixes_for(vocab: int, args) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]


async def drive(eng: AsyncEngine, args, prefixes: list[list[int]], requests: int) -> list[tuple[float, dict]]:
    """`requests` hits after a first wave (staggered, unless `--in-step`); each (TTFT s,
    its parts)."""
    rng = random.Random(1)
    # --ban-eos: EOS kept out through `logit_bias`, as serve_bench asks every server.
    bias = {t: -100.0 for t in eng.tokenizer.eos_token_ids} if args.ban_eos else {}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=not bias, logit_bias=bias,
                            output_kind="delta")
    pace = {"stream_interval_s": args.stream_interval_ms / 1e3, "max_chunks_per_s": args.max_chunks_per_s}
    ids, rows = itertools.count(), []

    async def one(max_tokens: int) -> tuple[float, dict]:
        i = next(ids)
        n = args.suffix_len
        if args.jitter:
            n = rng.randint(round(n * (1 - args.jitter)), round(n * (1 + args.jitter)))
        prompt = prefixes[i % len(prefixes)] + [rng.randrange(3, eng.vocab_size) for _ in range(n)]
        t0, first, parts = time.perf_counter(), None, {}
        async for out in eng.generate(None, replace(params, max_tokens=max_tokens), f"hit-{i}",
                                      prompt_token_ids=prompt, **pace):
            if first is None and out.outputs[0].delta_token_ids:
                first = time.perf_counter() - t0
                parts = out.metrics.ttft_parts() if out.metrics is not None else {}
        return first, parts

    async def stream(w: int) -> None:
        # Arrivals spread over the steps; --in-step: every stream's first request is as
        # long as the rest, so the streams finish, and send again, in the same steps, as
        # a load generator's equal-length streams started together do.
        await one(args.output_len if args.in_step else 1 + w * args.output_len // args.streams)
        while len(rows) < requests:
            rows.append(await one(args.output_len))

    await asyncio.gather(*(stream(w) for w in range(args.streams)))
    return rows


def through_loop(args, process: bool) -> dict:
    eng = AsyncEngine(engine_config(args), process=process)
    try:
        prefixes = prefixes_for(eng.vocab_size, args)
        asyncio.run(drive(eng, args, prefixes, 2 * args.streams))   # warm-up: prefixes cached
        clock = None if process else StepClock(eng.engine, time_loop=True)
        t0 = time.perf_counter()
        rows = asyncio.run(drive(eng, args, prefixes, args.requests))
        wall = time.perf_counter() - t0
        if clock is not None:
            clock.close()
    finally:
        eng.shutdown()
    ttft = [r[0] * 1e3 for r in rows]
    out = {"driver": "process" if process else "thread", "requests": len(rows),
           "ttft_p50_ms": statistics.median(ttft), "ttft_mean_ms": statistics.fmean(ttft), "wall_s": wall,
           "parts_p50_ms": {k: statistics.median(r[1][k] for r in rows if k in r[1]) * 1e3
                            for k in PART_NAMES if any(k in r[1] for r in rows)}}
    if clock is not None:
        out.update(step_rows(clock))
    return out


def stepped(args) -> dict:
    engine = LLMEngine(engine_config(args))
    prefixes = prefixes_for(engine.vocab_size, args)
    rng = random.Random(1)
    warm = argparse.Namespace(**{**vars(args), "requests": 2 * args.streams})
    run_pass(engine, "hit", warm, rng, prefixes, None)
    row = run_pass(engine, "hit", args, rng, prefixes, None)
    engine.close()
    return {"driver": "step", "requests": row["requests"], "ttft_p50_ms": row["ttft_p50_ms"],
            "ttft_mean_ms": row["ttft_mean_ms"], "wall_s": row["wall_s"],
            **{k: row[k] for k in ("mixed", "decode") if k in row}}


def step_rows(clock: StepClock) -> dict:
    out = {}
    for kind, rows in clock.steps.items():
        if kind == "idle":
            continue
        out[kind] = {"n": len(rows), **{p: statistics.fmean(r[p] for r in rows)
                                        for p in PARTS + ("wall", "between", "prefills")}}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap)
    ap.add_argument("--driver", nargs="+", choices=["step", "thread", "process"],
                    default=["step", "thread", "process"])
    ap.add_argument("--stream-interval-ms", type=float, default=50.0, help="the app's default pacing")
    ap.add_argument("--max-chunks-per-s", type=float, default=1000.0, help="the app's default cap")
    ap.add_argument("--ban-eos", action="store_true",
                    help="through AsyncEngine, EOS banned by logit_bias (as the HTTP benchmarks do) "
                         "instead of ignore_eos")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--results-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    rows = []
    for d in args.driver:
        rows.append(stepped(args) if d == "step" else through_loop(args, d == "process"))
        r = rows[-1]
        parts = " ".join(f"{k} {v:.2f}" for k, v in r.get("parts_p50_ms", {}).items())
        print(f"{d:>8}: TTFT p50 {r['ttft_p50_ms']:7.2f} ms  mean {r['ttft_mean_ms']:7.2f}  {parts}")
        for kind in ("mixed", "decode"):
            if kind in r:
                s = r[kind]
                print(f"{'':>10}{kind:>7} n {s['n']:4d} " + " ".join(
                    f"{p} {s[p]:.2f}" for p in PARTS + ("wall", "between", "prefills") if p in s))
    write_result(args.results_dir, f"loop_profile_{args.tag}.json", {**run_meta(args), "rows": rows})


if __name__ == "__main__":
    main()
