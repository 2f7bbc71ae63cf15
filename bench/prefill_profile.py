"""Prefill speed per chunk size and context length: dense (mlx-lm's own KV cache and
`generate_step`) vs paged (our engine, the prompt cut into chunks of that size).

Each point prefills one prompt of `context` tokens and samples one token; both sides
run warm, the median of `--repeats` is reported as prompt tokens per second.

    python bench/prefill_profile.py --model llama-1b --chunks 256 1024 4096 --contexts 512 2048 8192
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.bench_continuous_vs_static import RESULTS, resolve_model  # noqa: E402
from runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def dense(model, prompt: list[int], chunk: int) -> float:
    from mlx_lm.generate import generate_step

    t = time.perf_counter()
    for _ in generate_step(mx.array(prompt), model, max_tokens=1, prefill_step_size=chunk):
        pass
    return time.perf_counter() - t


def paged(engine: LLMEngine, prompt: list[int]) -> float:
    engine.kv.cache.reset()
    t = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--out", default=str(RESULTS / "prefill_profile_cpu.json"))
    args = ap.parse_args(argv)
    path = resolve_model(args.model)
    rows = []
    from mlx_lm import load
    model, _ = load(path)   # mlx-lm's own copy, as loaded (the engine's has fused projections)
    vocab = model.args.vocab_size
    for chunk in args.chunks:
        engine = LLMEngine(EngineConfig(model=path, max_num_batched_tokens=chunk, max_num_seqs=4,
                                        max_model_len=max(args.contexts) + 8,
                                        kv_cache_memory_bytes=4 << 30,
                                        attention_backend=args.attention_backend))
        for ctx in args.contexts:
            prompt = [(31 * i + 7) % (vocab - 3) + 3 for i in range(ctx)]
            dense(model, prompt, chunk), paged(engine, prompt)          # warm up these shapes
            d = float(np.median([dense(model, prompt, chunk) for _ in range(args.repeats)]))
            p = float(np.median([paged(engine, prompt) for _ in range(args.repeats)]))
            row = {"chunk": chunk, "context": ctx, "dense_s": d, "paged_s": p,
                   "dense_tok_s": ctx / d, "paged_tok_s": ctx / p, "paged_vs_dense": d / p}
            rows.append(row)
            print(f"chunk {chunk:>5} context {ctx:>6}: dense {row['dense_tok_s']:>10.0f} tok/s  "
                  f"paged {row['paged_tok_s']:>10.0f} tok/s  ({row['paged_vs_dense']:.2f}x)", flush=True)
        del engine
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "device": str(mx.default_device()),
                                          "rows": rows}, indent=2))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
