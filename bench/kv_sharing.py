"""Block-level KV sharing between live requests: how much KV memory and prefill work
it saves. Two cases, in-process, each run with the prefix cache on and off and, for
scale, on mlx-lm's `BatchGenerator` (the batcher `mlx_lm.server` runs, which keeps a
dense cache per sequence):

- `shared prefix`: `--streams` requests arrive together, each a shared `--prefix-len`
  prompt (a system prompt, a document) plus its own `--suffix-len` tokens. With the
  cache on, the first request's prefix blocks are published when they are allocated,
  so the others in the same step attend to them instead of computing their own.
- `parallel sampling`: one `--prefix-len` prompt with `n` = `--n` sampled completions;
  the `n` sequences share the prompt's blocks.

Each row: the peak KV bytes held, the prompt tokens computed, throughput and TTFT.
Writes `bench/results/kv_sharing_<tag>.json`.

    python bench/kv_sharing.py                                     # CPU, embedded model
    python bench/kv_sharing.py --model llama-1b --tag gpu --streams 64 --prefix-len 4096 --n 16 \\
        --kv-cache-gb 16
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import (RESULTS, resolve_model, run_meta, run_mlx_lm, run_ours,  # noqa: E402
                                              write_result)

from runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def requests(vocab: int, args) -> dict[str, list[tuple[list[int], int]]]:
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    prefix = tokens(args.prefix_len)
    return {"shared prefix": [(prefix + tokens(args.suffix_len), args.gen_len) for _ in range(args.streams)],
            "parallel sampling": [(tokens(args.prefix_len), args.gen_len)]}


def run_n(engine: LLMEngine, prompt: list[int], gen: int, n: int) -> dict:
    """One request of `n` sampled completions, to the end."""
    params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request("n", None, params, prompt_token_ids=prompt)
    first, out = None, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            first = first or time.perf_counter()
            out = o
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in out.outputs)
    return {"output_tok_s": tokens / wall, "ttft_p50_s": first - t0, "output_tokens": tokens, "wall_s": wall}


def ours(model: str, case: str, reqs, args, apc: bool) -> dict:
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=max(args.streams, args.n),
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
                                    enable_prefix_caching=apc))
    if case == "parallel sampling":
        row = run_n(engine, reqs[0][0], reqs[0][1], args.n)
    else:
        row = run_ours(engine, reqs, len(reqs), "ours")
    s = engine.stats()
    engine.close()
    seqs_per_prompt = args.n if case == "parallel sampling" else 1
    return {"case": case, "system": "ours" if apc else "ours-no-apc", "output_tok_s": row["output_tok_s"],
            "ttft_p50_s": row["ttft_p50_s"], "kv_bytes_peak": s["kv_cache_bytes_peak"],
            "prompt_tokens": s["prompt_tokens"] * seqs_per_prompt,
            "prompt_tokens_computed": s["prompt_tokens"] * seqs_per_prompt - s["prefix_cache_hit_tokens"]}


def dense(plain, case: str, reqs, args) -> dict:
    kv: list[int] = []
    batch = reqs * args.n if case == "parallel sampling" else reqs
    row = run_mlx_lm(plain, batch, len(batch), on_step=lambda g: kv.append(g.prompt_cache_nbytes))
    return {"case": case, "system": "mlx-lm BatchGenerator", "output_tok_s": row["output_tok_s"],
            "ttft_p50_s": row["ttft_p50_s"], "kv_bytes_peak": float(max(kv)),
            "prompt_tokens": sum(len(p) for p, _ in batch), "prompt_tokens_computed": sum(len(p) for p, _ in batch)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default', 'llama-1b' (random, bf16) or a path")
    ap.add_argument("--tag", default="cpu", help="results go to kv_sharing_<tag>.json")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0,
                    help="room for every sequence unshared: no preemption in any row")
    ap.add_argument("--no-dense", action="store_true", help="skip mlx-lm's BatchGenerator")
    ap.add_argument("--results-dir", default=str(RESULTS))
    args = ap.parse_args(argv)

    model = resolve_model(args.model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    plain = None
    if not args.no_dense:
        from mlx_lm import load

        plain, _ = load(model)
    rows = []
    for case, reqs in requests(vocab, args).items():
        for apc in (True, False):
            rows.append(ours(model, case, reqs, args, apc))
        if plain is not None:
            rows.append(dense(plain, case, reqs, args))
    summary = {}
    for case in dict.fromkeys(r["case"] for r in rows):
        at = {r["system"]: r for r in rows if r["case"] == case}
        on = at["ours"]
        summary[case] = {f"{name}_over_ours": {"kv_bytes_peak": r["kv_bytes_peak"] / on["kv_bytes_peak"],
                                               "prompt_tokens_computed": r["prompt_tokens_computed"]
                                               / on["prompt_tokens_computed"]}
                         for name, r in at.items() if name != "ours"}
    print(f"\n{'case':>18} {'system':>22} {'peak KV MiB':>12} {'prompt tokens computed':>23} {'tok/s':>8} "
          f"{'TTFT p50 ms':>12}")
    for r in rows:
        print(f"{r['case']:>18} {r['system']:>22} {r['kv_bytes_peak'] / 2**20:12.2f} "
              f"{r['prompt_tokens_computed']:>10d} of {r['prompt_tokens']:<10d} {r['output_tok_s']:8.1f} "
              f"{r['ttft_p50_s'] * 1e3:12.1f}")
    print(json.dumps(summary, indent=1))
    write_result(args.results_dir, f"kv_sharing_{args.tag}.json", {"meta": run_meta(args), "summary": summary,
                                                                    "rows": rows})


if __name__ == "__main__":
    main()
