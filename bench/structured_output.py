"""What a structured-output constraint costs the engine, in-process, measured side by
side with the same requests unconstrained.

Each system runs the same requests (random prompts, a fixed number of new tokens, EOS
banned through `logit_bias` so every request runs to its length) at each concurrency:

- `free`: no constraint (the anchor);
- `constrained`: every request under the regex `[ -~]+` (any printable ASCII), which
  never completes, so it costs a full mask every token: the worst case per token;
- `half constrained`: every other request constrained: what a constrained request
  costs the free ones beside it (while one runs, each step is read back before the
  next is queued).

The systems alternate within each round; each figure is the median over `--rounds`.
A microbenchmark times the mask itself (llguidance's bitmask for every row, sent to
the device and unpacked there) at each batch size.

`--compile-stall` measures what compiling new grammars costs the streams beside them,
through the engine loop (`AsyncEngine`, as a server runs it): `--stall-streams` free
streams decode while, every `--schema-interval-s`, a request arrives with a JSON schema
of `--schema-properties` properties not seen before (a cache miss: a full compile). The
loop compiles it on a thread (as shipped) or on the loop itself (`GRAMMAR_THREADS = 0`,
how it was before); the two alternate for `--rounds`, and the free streams' throughput
and gaps between their tokens are compared. Writes
`bench/results/structured_output_<tag>.json` (`structured_output_compile_<tag>.json`).

    python bench/structured_output.py                 # CPU, embedded model
    python bench/structured_output.py --compile-stall
    python bench/structured_output.py --model llama-1b --tag gpu --concurrency 1 16 64 256
"""

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import RESULTS, median_row, resolve_model, run_meta, run_ours  # noqa: E402

from runtime import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams  # noqa: E402
from runtime.structured_output import allowed_tokens  # noqa: E402

ANY_TEXT = StructuredOutputsParams(regex=r"[ -~]+")
SYSTEMS = {"free": lambda i: False, "constrained": lambda i: True, "half constrained": lambda i: i % 2 == 1}


def make_params(engine: LLMEngine, constrained):
    ban_eos = {t: -100.0 for t in engine.eos_token_ids}

    def params(i: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, logit_bias=dict(ban_eos),
                              structured_outputs=ANY_TEXT if constrained(i) else None)
    return params


def mask_time(engine: LLMEngine, batch: int, reps: int = 20) -> float:
    """Seconds to make and apply one step's masks for `batch` constrained rows."""
    grammar = engine._grammars.compile(ANY_TEXT)
    grammars = [grammar.copy() for _ in range(batch)]
    logits = mx.zeros((batch, engine.vocab_size))
    mx.eval(mx.where(allowed_tokens(grammars, engine.vocab_size), logits, -mx.inf))
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(mx.where(allowed_tokens(grammars, engine.vocab_size), logits, -mx.inf))
    return (time.perf_counter() - t0) / reps


def big_schema(tag: int, properties: int) -> dict:
    """A JSON schema of `properties` arrays of small objects, distinct for each `tag`."""
    item = {"type": "object", "properties": {"x": {"type": "string", "pattern": "[a-z]{3,40}"},
                                             "y": {"enum": [f"v{j}" for j in range(50)]}}}
    names = [f"k{i}_{tag}" for i in range(properties)]
    return {"type": "object", "properties": {n: {"type": "array", "items": item} for n in names},
            "required": names}


async def stall_run(engine, args, vocab: int, tags) -> dict:
    """Free streams decode for `--stall-seconds` while new schemas arrive; their tokens,
    the gaps between them and each schema request's TTFT."""
    rng = random.Random(1)
    ban_eos = {t: -100.0 for t in engine.engine.eos_token_ids}
    free = SamplingParams(temperature=0, max_tokens=args.gen_len, logit_bias=ban_eos, output_kind="delta")
    stop_at = time.monotonic() + args.stall_seconds
    tokens, gaps, ttfts = [0], [], []

    async def stream():
        while time.monotonic() < stop_at:
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
            last = None
            async for o in engine.generate(None, free, prompt_token_ids=prompt):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if o.finished:
                    tokens[0] += len(o.outputs[0].token_ids)

    async def constrained():
        t0 = time.monotonic()
        so = StructuredOutputsParams(json=big_schema(next(tags), args.schema_properties))
        params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=so)
        async for o in engine.generate(None, params, prompt_token_ids=[rng.randrange(3, vocab) for _ in range(16)]):
            ttfts.append(time.monotonic() - t0)
            break

    async def arrivals():
        pending = []
        while time.monotonic() < stop_at:
            pending.append(asyncio.ensure_future(constrained()))
            await asyncio.sleep(args.schema_interval_s)
        await asyncio.gather(*pending)

    t0 = time.monotonic()
    await asyncio.gather(arrivals(), *(stream() for _ in range(args.stall_streams)))
    gaps.sort()

    def q(p):
        return gaps[min(len(gaps) - 1, int(p * len(gaps)))] if gaps else None
    return {"free_tokens": tokens[0], "seconds": time.monotonic() - t0, "schemas": len(ttfts),
            "gap_p50_s": q(0.5), "gap_p99_s": q(0.99), "gap_max_s": gaps[-1] if gaps else None,
            "schema_ttft_p50_s": sorted(ttfts)[len(ttfts) // 2] if ttfts else None}


def compile_stall(args) -> dict:
    import itertools

    from runtime import AsyncEngine, engine_loop

    engine = AsyncEngine(EngineConfig(model=resolve_model(args.model), max_num_seqs=args.stall_streams + 8,
                                      kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30)))
    vocab = min(engine.vocab_size, len(engine.tokenizer._tokenizer))
    tags = itertools.count()
    so = StructuredOutputsParams(json=big_schema(-1, args.schema_properties))
    t0 = time.perf_counter()
    engine.engine.compile_grammar(SamplingParams(structured_outputs=so), [1, 2, 3])
    compile_s = time.perf_counter() - t0
    systems = {"on a thread": 2, "on the loop": 0}
    runs = {name: [] for name in systems}
    try:
        warm_up = argparse.Namespace(**{**vars(args), "stall_seconds": 2.0})
        asyncio.run(stall_run(engine, warm_up, vocab, tags))
        for r in range(args.rounds):
            for name in (list(systems) if r % 2 == 0 else list(reversed(systems))):
                engine_loop.GRAMMAR_THREADS = systems[name]
                run = asyncio.run(stall_run(engine, args, vocab, tags))
                run["free_tok_s"] = run["free_tokens"] / run["seconds"]
                runs[name].append(run)
                print(f"round {r} {name:<12} free {run['free_tok_s']:7.1f} tok/s, gap p99 "
                      f"{run['gap_p99_s'] * 1e3:6.1f} ms, max {run['gap_max_s'] * 1e3:6.1f} ms, "
                      f"{run['schemas']} schemas", flush=True)
    finally:
        engine_loop.GRAMMAR_THREADS = systems["on a thread"]
        engine.shutdown()

    def med(name, key):
        vals = sorted(r[key] for r in runs[name])
        return vals[len(vals) // 2]
    rows = [{"system": name, **{k: med(name, k) for k in ("free_tok_s", "gap_p50_s", "gap_p99_s", "gap_max_s",
                                                          "schema_ttft_p50_s")},
             "runs": runs[name]} for name in systems]
    base = rows[1]["free_tok_s"]
    print(f"\none compile of a {args.schema_properties}-property schema: {compile_s * 1e3:.1f} ms")
    print(f"{'compile':<12} {'free tok/s':>10} {'vs loop':>8} {'gap p50 ms':>11} {'gap p99 ms':>11} "
          f"{'gap max ms':>11} {'schema TTFT p50 ms':>19}")
    for row in rows:
        print(f"{row['system']:<12} {row['free_tok_s']:>10.1f} {row['free_tok_s'] / base:>8.3f} "
              f"{row['gap_p50_s'] * 1e3:>11.1f} {row['gap_p99_s'] * 1e3:>11.1f} {row['gap_max_s'] * 1e3:>11.1f} "
              f"{row['schema_ttft_p50_s'] * 1e3:>19.1f}")
    return {"compile_ms": compile_s * 1e3, "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-gb", type=float, default=0.5)
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--compile-stall", action="store_true", help="the compile A/B alone (see above)")
    ap.add_argument("--stall-streams", type=int, default=16)
    ap.add_argument("--stall-seconds", type=float, default=8.0)
    ap.add_argument("--schema-interval-s", type=float, default=0.25)
    ap.add_argument("--schema-properties", type=int, default=200)
    args = ap.parse_args(argv)
    if args.compile_stall:
        out = Path(args.results_dir) / f"structured_output_compile_{args.tag}.json"
        out.write_text(json.dumps({"meta": run_meta(args), **compile_stall(args)}, indent=1))
        print(f"wrote {out}")
        return
    engine = LLMEngine(EngineConfig(model=resolve_model(args.model), max_num_seqs=max(args.concurrency),
                                    kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
                                    enable_prefix_caching=False))
    rng = random.Random(0)
    vocab = min(engine.vocab_size, len(engine._hf))
    rows = []
    for c in args.concurrency:
        n = max(c * args.requests_per_stream, 4)
        reqs = [([rng.randrange(3, vocab) for _ in range(args.prompt_len)], args.gen_len) for _ in range(n)]
        run_ours(engine, reqs[:2], 2, "warm-up", params=make_params(engine, SYSTEMS["constrained"]))
        runs = {name: [] for name in SYSTEMS}
        for r in range(args.rounds):
            order = list(SYSTEMS) if r % 2 == 0 else list(reversed(SYSTEMS))
            for name in order:
                runs[name].append(run_ours(engine, reqs, c, name, params=make_params(engine, SYSTEMS[name])))
        for name in SYSTEMS:
            row = median_row(runs[name])
            row["concurrency"] = c
            rows.append(row)
    free = {r["concurrency"]: r["output_tok_s"] for r in rows if r["system"] == "free"}
    for r in rows:
        r["tok_s_vs_free"] = r["output_tok_s"] / free[r["concurrency"]]
    masks = [{"batch": b, "mask_ms_per_step": mask_time(engine, b) * 1e3} for b in args.concurrency]

    print(f"\n{'streams':>7} {'system':<17} {'tok/s':>8} {'vs free':>8} {'TTFT p50 ms':>12}  per round")
    for r in rows:
        per = ", ".join(f"{x:.0f}" for x in r["runs_output_tok_s"])
        print(f"{r['concurrency']:>7} {r['system']:<17} {r['output_tok_s']:>8.1f} {r['tok_s_vs_free']:>8.3f} "
              f"{r['ttft_p50_s'] * 1e3:>12.1f}  {per}")
    for m in masks:
        print(f"mask for {m['batch']:>4} rows: {m['mask_ms_per_step']:.3f} ms per step")
    out = Path(args.results_dir) / f"structured_output_{args.tag}.json"
    out.write_text(json.dumps({"meta": {**run_meta(args), "vocab_size": engine.vocab_size,
                                        "tokenizer_vocab": len(engine._hf)},
                               "rows": rows, "mask": masks}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
