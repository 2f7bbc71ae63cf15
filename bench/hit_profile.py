"""Where a prefix hit's time to first token goes, in the engine alone (no HTTP, no Ray).

The bundle's prefix workload, driven in-process: `--streams` requests run at once, each a
prompt of one of `--num-prefixes` shared prefixes plus a fresh suffix, generating
`--output-len` tokens; a finished request is replaced at once (closed loop). Two passes
on one engine: "hit" (the prefixes cached by a warm-up) and "miss" (every prompt's prefix
fresh, so nothing is cached; the same lengths). Per request: steps and milliseconds from
`add_request` to its first token's output, when the engine hands it on as a server's loop
gets it: to its `output_sink` (from the worker thread, or read back before the next step
is built) or returned from `step()`. Per step, by what it computes
("mixed": some prompt tokens beside decodes; "decode": one token per sequence): the wall
time and its parts: scheduling, building the lazy graph, queuing it on the device
(encoding kernels; on MLX's CPU backend, computing it too), waiting for the device, and
processing tokens. `--early-read off on` runs both passes with and without reading a
first token's step back before the next is built (`EARLY_READ_MAX_TOKENS`), on one engine;
`--prefill-kernel off on` with short prefill chunks through the matmul way and through
the fused CUDA prefill kernel. `--in-step`: the streams' first requests are not staggered,
so hits arrive in waves, one per `--output-len` steps.

    python bench/hit_profile.py --model llama-1b --prefix-len 2048 --suffix-len 64 --streams 8
"""

import argparse
import cProfile
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import COMPILE, RESULTS, resolve_model, run_meta, write_result  # noqa: E402
from bench.step_clock import PARTS, StepClock, top_functions  # noqa: E402
import mlx.core as mx  # noqa: E402

from runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def run_pass(engine: LLMEngine, kind: str, args, rng: random.Random, prefixes: list[list[int]],
             prof: cProfile.Profile | None) -> dict:
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, output_kind="delta")
    added: dict[str, tuple[float, int, bool]] = {}
    ttft_ms, ttft_steps, cached = [], [], []
    counter = iter(range(1 << 30))

    def toks(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    def add():
        i = next(counter)
        prefix = prefixes[i % len(prefixes)] if kind == "hit" else toks(args.prefix_len)
        rid = f"{kind}-{i}"
        # The first wave's lengths are staggered so that arrivals spread over the steps,
        # as a server's do, rather than all landing in one.
        first = i < args.streams
        sp = replace(params, max_tokens=1 + i * args.output_len // args.streams) \
            if first and not args.in_step else params
        n = args.suffix_len
        if args.jitter:   # suffixes of ragged lengths, as text prompts tokenize to
            n = rng.randint(round(n * (1 - args.jitter)), round(n * (1 + args.jitter)))
        engine.add_request(rid, None, sp, prompt_token_ids=prefix + toks(n))
        added[rid] = (time.perf_counter(), n_steps, first)

    n_steps = 0
    sent: deque = deque()   # (when, outputs) handed to the sink, from either thread
    engine.output_sink = lambda outs: sent.append((time.perf_counter(), outs))
    for _ in range(args.streams):
        add()
    clock = StepClock(engine)
    if prof:
        prof.enable()
    done = 0
    t0 = time.perf_counter()
    while done < args.requests:
        outs = clock.step()
        n_steps += 1
        batches = [sent.popleft() for _ in range(len(sent))] + [(time.perf_counter(), outs)]
        for at, outs in batches:
            for out in outs:
                if out.request_id in added and out.outputs[0].delta_token_ids:
                    t, s, first = added.pop(out.request_id)
                    if not first:   # the first wave arrives together: not steady state
                        ttft_ms.append((at - t) * 1e3)
                        ttft_steps.append(n_steps - s)
                        cached.append(out.num_cached_tokens)
                if out.finished:
                    done += 1
                    add()
    wall = time.perf_counter() - t0
    if prof:
        prof.disable()
    clock.close()
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.output_sink = None
    row = {"pass": kind, "requests": len(ttft_ms), "ttft_p50_ms": statistics.median(ttft_ms),
           "ttft_mean_ms": statistics.fmean(ttft_ms), "ttft_steps_p50": statistics.median(ttft_steps),
           "cached_tokens_p50": statistics.median(cached),
           "steps": n_steps, "wall_s": wall}
    for k, rows in clock.steps.items():
        row[k] = {"n": len(rows), **{p: statistics.fmean(r[p] for r in rows) for p in PARTS + ("wall",)}}
        row[k]["wall_p50"] = statistics.median(r["wall"] for r in rows)
    return row


def workload_args(ap: argparse.ArgumentParser) -> None:
    """The prefix workload's arguments, shared with loop_profile.py."""
    ap.add_argument("--model", default="default")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--jitter", type=float, default=0.0,
                    help="suffix lengths uniform within this share of --suffix-len either side")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64, help="requests finished per pass")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--kv-cache-gb", type=float, default=4.0)
    ap.add_argument("--in-step", action="store_true",
                    help="the streams' first requests not staggered: they finish, and send again, "
                         "in the same steps, as a load generator's equal-length streams do")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap)
    ap.add_argument("--compile-decode", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--pad-rows", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                    help="a step's rows padded to a grid (auto: where matmuls plan per shape, CUDA); "
                         "each given mode runs its warm-up and both passes on the one engine")
    ap.add_argument("--early-read", nargs="+", choices=["on", "off"], default=["on"],
                    help="a small first-token step read back before the next is built (on: the "
                         "engine's rule); each given mode runs within each --pad-rows mode")
    ap.add_argument("--prefill-kernel", nargs="+", choices=["on", "off"], default=["on"],
                    help="short prefill chunks through the fused CUDA prefill kernel (on, where the "
                         "backend has it) or gather; each given mode runs within each --early-read mode")
    ap.add_argument("--cprofile", nargs="?", const="hit", choices=["hit", "miss"],
                    help="top host functions of the first hit (or miss) pass")
    ap.add_argument("--graph-prefill-tokens", type=int, default=0,
                    help="prefill chunks of up to this many tokens run in the compiled decode graph")
    ap.add_argument("--buffer-cache-gb", type=float, default=None,
                    help="MLX's buffer cache limit (default: the engine's, bounded by its KV pool)")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--results-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=resolve_model(args.model), max_num_seqs=max(args.streams, 8),
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
                                    compile_decode=COMPILE[args.compile_decode],
                                    graph_prefill_tokens=args.graph_prefill_tokens,
                                    buffer_cache_bytes=None if args.buffer_cache_gb is None
                                    else int(args.buffer_cache_gb * 2**30)))
    rng = random.Random(0)
    # With --jitter the prefixes' lengths differ too, not all a whole number of blocks.
    prefixes = [[rng.randrange(3, engine.vocab_size) for _ in range(args.prefix_len + (7 * i if args.jitter else 0))]
                for i in range(args.num_prefixes)]
    auto = engine.runner.pad_rows
    prof = cProfile.Profile() if args.cprofile else None
    rows, ratios = [], {}
    reads_early = engine._reads_early
    prefill = {"on": engine.runner.ctx.prefill_fn, "off": None}
    modes = [(pad, early, kern) for pad in args.pad_rows for early in args.early_read for kern in args.prefill_kernel]
    for i, (mode, early, kern) in enumerate(modes):
        engine.runner.pad_rows = {"auto": auto, "on": True, "off": False}[mode]
        engine._reads_early = reads_early if early == "on" else (lambda pending: False)
        engine.runner.ctx.prefill_fn = prefill[kern]
        # Warm-up: the kernels and shapes of both passes, and the prefixes cached.
        warm = argparse.Namespace(**{**vars(args), "requests": 2 * args.streams})
        run_pass(engine, "miss", warm, rng, prefixes, None)
        run_pass(engine, "hit", warm, rng, prefixes, None)
        miss, hit = (run_pass(engine, "miss", args, rng, prefixes, prof if i == 0 and args.cprofile == "miss" else None),
                     run_pass(engine, "hit", args, rng, prefixes, prof if i == 0 and args.cprofile == "hit" else None))
        for r in (miss, hit):
            r["pad_rows"], r["early_read"], r["prefill_kernel"] = mode, early, kern
        rows += [miss, hit]
        key = mode + (f", early read {early}" if len(args.early_read) > 1 else "") \
            + (f", prefill kernel {kern}" if len(args.prefill_kernel) > 1 else "")
        ratios[key] = miss["ttft_p50_ms"] / hit["ttft_p50_ms"]
    print(f"attention backend {engine.runner.attention_backend}, {mx.default_device()}; "
          f"TTFT in the engine, miss/hit: " + ", ".join(f"{v:.2f}x (rows padded: {k})" for k, v in ratios.items()))
    print(f"{'padded':>6} | {'early':>5} | {'kernel':>6} | {'pass':>5} | {'TTFT p50 ms':>11} | {'steps':>5} | {'step kind':>9} | "
          f"{'n':>4} | {'wall ms':>8} | " + " | ".join(f"{p:>8}" for p in PARTS))
    for r in rows:
        for k in ("mixed", "decode"):
            if k in r:
                s = r[k]
                print(f"{r['pad_rows']:>6} | {r['early_read']:>5} | {r['prefill_kernel']:>6} | {r['pass']:>5} | {r['ttft_p50_ms']:>11.1f} | "
                      f"{r['ttft_steps_p50']:>5} | "
                      f"{k:>9} | {s['n']:>4} | {s['wall']:>8.2f} | " + " | ".join(f"{s[p]:>8.2f}" for p in PARTS))
    out = {**run_meta(args), "attention_backend": engine.runner.attention_backend,
           "prefill_kernel_serves": prefill["on"] is not None,
           "pad_rows_auto": auto, "ttft_ratio_miss_over_hit": ratios, "rows": rows}
    if prof:
        key = f"{args.cprofile}_top_ms_per_step"
        profiled = next(r for r in rows if r["pass"] == args.cprofile)   # the first mode's pass
        out[key] = top_functions(prof, profiled["steps"], 25)
        for name, ms in out[key]:
            print(f"{ms:8.3f} ms/step  {name}")
    write_result(args.results_dir, f"hit_profile_{args.tag}.json", out)


if __name__ == "__main__":
    main()
