"""Sliding-window layers' K/V in window slots (kv/window_slots.py) against one pool of
every layer, on the same KV budget.

A model with sliding-window layers (Gemma 3: five of every six; gpt-oss: every other
one) needs their K/V only for each sequence's last W tokens. In one pool a block holds
every layer's K/V for its tokens, so a long context holds its sliding layers' whole
history too; with the window pool (`EngineConfig.window_pool`, the default) the main
pool's blocks hold the full-attention layers' K/V alone, and the sliding layers' sit in
window slots lent to the blocks their windows reach.

Per model shape and mode, on one KV budget (`--contexts` whole requests' worth in one
pool): the main pool's blocks and the context tokens they hold, the window slots, then
a closed loop of long-prompt requests run to completion (`run_ours`): output tokens a
second, TTFT, preemptions, peak KV bytes in use, and whether every request's greedy
tokens match the other mode's. Writes `bench/results/window_pool_<tag>.json`.

    python bench/window_pool.py                                       # CPU, small models
    python bench/window_pool.py --tag gpu_h100 --hidden 1024 --layers 12 --heads 16 \\
        --kv-heads 4 --window 128 --prompt-len 4096 --gen-len 64 --streams 32 --requests 64 --dtype bfloat16
"""

import argparse
import random
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import RESULTS, run_meta, run_ours, write_result  # noqa: E402
from runtime import EngineConfig, LLMEngine  # noqa: E402
from runtime.models.tiny import make_model  # noqa: E402

SHAPES = {"gemma3": ("gemma3_text", 6), "gpt-oss": ("gpt_oss", 2)}   # arch, every n-th layer full


def run_mode(path: str, args, budget: int, window_pool: bool, reqs) -> tuple[dict, dict]:
    engine = LLMEngine(EngineConfig(model=path, kv_cache_memory_bytes=budget, window_pool=window_pool,
                                    max_num_seqs=args.streams, block_size=args.block_size,
                                    max_num_batched_tokens=args.max_batched_tokens))
    finals: dict[int, list[int]] = {}
    row = run_ours(engine, reqs, args.streams, "ours", finals=finals)
    s = engine.stats()
    engine.close()
    row.update(window_pool=window_pool, num_blocks=s["num_total_blocks"], window_slots=s["window_slots_total"],
               context_tokens=s["num_total_blocks"] * s["block_size"], kv_bytes_pool=s["kv_cache_bytes_total"],
               kv_bytes_peak=s["kv_cache_bytes_peak"], preemptions=s["preemptions"],
               blocks_held_after=s["num_blocks_held_by_requests"], slots_held_after=s["window_slots_in_use"])
    return row, finals


def first_difference(a: dict[int, list[int]], b: dict[int, list[int]]) -> int | None:
    """The earliest output position where two runs' tokens differ, over all requests
    (None: the same everywhere). On a GPU, in bfloat16, batches of other sizes round
    differently, so greedy tokens of random weights part after a few positions."""
    return min((next(j for j, (x, y) in enumerate(zip(a[i], b[i])) if x != y) for i in a if a[i] != b[i]),
               default=None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--contexts", type=float, default=8.0,
                    help="the KV budget: this many requests' whole contexts in one pool of every layer")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--results-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    args.model = "random-weight " + ", ".join(f"{s}-shaped" for s in args.shapes)

    rng = random.Random(0)
    reqs = [([rng.randrange(3, 500) for _ in range(args.prompt_len)], args.gen_len) for _ in range(args.requests)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            arch, pattern = SHAPES[shape]
            path = str(make_model(Path(tmp) / shape, arch=arch, hidden=args.hidden, layers=args.layers,
                                  heads=args.heads, kv_heads=args.kv_heads, context=4 * (args.prompt_len + args.gen_len),
                                  sliding_window=args.window, window_pattern=pattern, dtype=args.dtype, seed=1))
            head_dim = args.hidden // args.heads
            per_token = 2 * args.layers * args.kv_heads * head_dim * getattr(mx, args.dtype).size
            budget = int(args.contexts * (args.prompt_len + args.gen_len) * per_token)
            one, one_tokens = run_mode(path, args, budget, False, reqs)
            apart, apart_tokens = run_mode(path, args, budget, True, reqs)
            same = sum(one_tokens[i] == apart_tokens[i] for i in one_tokens)
            for r in (one, apart):
                r.update(shape=shape, budget_bytes=budget, tokens_match=same == len(reqs),
                         requests_matching=same, first_difference=first_difference(one_tokens, apart_tokens))
                rows.append(r)
    print(f"{'shape':8} {'mode':12} {'blocks':>7} {'slots':>6} {'ctx tokens':>10} {'tok/s':>8} "
          f"{'TTFT p50':>9} {'preempt':>7} {'peak MiB':>9} same tokens")
    for r in rows:
        print(f"{r['shape']:8} {'window pool' if r['window_pool'] else 'one pool':12} {r['num_blocks']:7d} "
              f"{r['window_slots']:6d} {r['context_tokens']:10d} {r['output_tok_s']:8.1f} "
              f"{r['ttft_p50_s'] * 1e3:7.0f}ms {r['preemptions']:7d} {r['kv_bytes_peak'] / 2**20:9.2f} "
              f"{r['requests_matching']}/{len(reqs)}")
    write_result(args.results_dir, f"window_pool_{args.tag}.json", {"meta": run_meta(args), "rows": rows})


if __name__ == "__main__":
    main()
