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
the device and unpacked there) at each batch size. Writes
`bench/results/structured_output_<tag>.json`.

    python bench/structured_output.py                 # CPU, embedded model
    python bench/structured_output.py --model llama-1b --tag gpu --concurrency 1 16 64 256
"""

import argparse
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
    args = ap.parse_args(argv)
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
