"""Prefix hits prefilled in one step beside a whole new prompt: the hits grouped by
their number of new tokens (`query_class`, as shipped) against one class for all
prefill (the grouping before it, by context alone, where the hits were padded in
queries to the prompt's length). One engine, arms alternating by round.

Each wave is `--hits` requests over cached `--prefix-len`-token prefixes, each with
`--suffix-len` new tokens, and one new prompt of about the same length, all added at
once, one output token each; the time is from adding them to the last first token.
The same hits alone and the prompt alone, in the same rounds, are what the wave would
cost if nothing were padded.

    python bench/mixed_prefill.py                                    # embedded model, CPU
    python bench/mixed_prefill.py --model llama-1b --prefix-len 2048 --suffix-len 84 \\
        --hits 8 --kv-cache-gb 8 --out bench/results/mixed_prefill_gpu.json   # 1B shape, GPU
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import RESULTS, resolve_model  # noqa: E402
from bench.paged_attention import write_results  # noqa: E402
import mlx.core as mx  # noqa: E402

from runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from runtime.attention import metadata  # noqa: E402

ARMS = ("query classes", "one class")
PARTS = ("wave", "hits alone", "prompt alone")


def _run(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    """Seconds from adding `prompts` to the last one's first (and only) token."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    mx.synchronize()
    t = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", None, params, prompt_token_ids=ids)
    while engine.has_unfinished_requests():
        engine.step()
    mx.synchronize()
    return time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--hits", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--out", default=str(RESULTS / "mixed_prefill_cpu.json"))
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=resolve_model(args.model),
                                    kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
                                    max_num_batched_tokens=(args.hits + 1) * (args.prefix_len + args.suffix_len)))
    rng = random.Random(0)
    vocab = engine.vocab_size
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    prefixes = [tokens(args.prefix_len) for _ in range(args.num_prefixes)]
    _run(engine, [p + tokens(args.suffix_len) for p in prefixes], "prime")
    shipped = metadata.query_class
    times = {(arm, part): [] for arm in ARMS for part in PARTS}
    for rnd in range(args.rounds + 1):            # round 0 warms up every shape
        for arm in (ARMS if rnd % 2 else ARMS[::-1]):
            metadata.query_class = shipped if arm == ARMS[0] else (lambda n: 0)
            try:
                for part in PARTS:
                    hits = [prefixes[i % args.num_prefixes] + tokens(args.suffix_len) for i in range(args.hits)]
                    prompt = [tokens(args.prefix_len + args.suffix_len)]
                    batch = {"wave": hits + prompt, "hits alone": hits, "prompt alone": prompt}[part]
                    took = _run(engine, batch, f"r{rnd}-{arm}-{part}")
                    if rnd:
                        times[arm, part].append(took * 1e3)
            finally:
                metadata.query_class = shipped
    assert engine.stats()["num_blocks_held_by_requests"] == 0
    rows = []
    print(f"{'grouping':>14} {'wave ms':>9} {'hits alone':>11} {'prompt alone':>13} {'wave / sum':>11}")
    for arm in ARMS:
        med = {part: statistics.median(times[arm, part]) for part in PARTS}
        ratio = med["wave"] / (med["hits alone"] + med["prompt alone"])
        rows.append({"grouping": arm, **{f"{p.replace(' ', '_')}_ms": med[p] for p in PARTS},
                     "wave_over_parts": ratio, "samples_ms": {p: times[arm, p] for p in PARTS}})
        print(f"{arm:>14} {med['wave']:9.1f} {med['hits alone']:11.1f} {med['prompt alone']:13.1f} {ratio:11.2f}")
    w = {r["grouping"]: r["wave_ms"] for r in rows}
    print(f"wave, one class / query classes: {w[ARMS[1]] / w[ARMS[0]]:.2f}x")
    write_results(Path(args.out), args, rows)


if __name__ == "__main__":
    main()
