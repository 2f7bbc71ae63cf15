"""Fused q/k/v and gate/up projections (`runtime/models/fuse.py`) against unfused, in one
process with runs alternating: the time to prefill `--prefill-prompts` prompts in one
step, and decode step time per batch size. A third engine fuses at every input
size, to show why prefill chunks keep one matmul per projection.

    python bench/fuse_projections.py                    # embedded model, CPU-sized
    python bench/fuse_projections.py --model llama-1b --batch 1 32 128 256 \
        --prompt-len 512 --prefill-prompts 32 --kv-cache-gb 8   # the GPU run
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import RESULTS, resolve_model  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

VARIANTS = ("unfused", "fused", "fused-every-size")


def _add(engine: LLMEngine, tag: str, n: int, prompt_len: int, max_tokens: int) -> None:
    for i in range(n):
        ids = [(7 * i + 13 * j + len(tag)) % (engine.vocab_size - 3) + 3 for j in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", None, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                              ignore_eos=True, output_kind="delta"),
                           prompt_token_ids=ids)


def _drain(engine: LLMEngine) -> None:
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.cache.reset()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--kv-cache-gb", type=float, default=4.0)
    ap.add_argument("--out", default=str(RESULTS / "fuse_projections_cpu.json"))
    args = ap.parse_args(argv)
    path = resolve_model(args.model)
    engines = {}
    for name in VARIANTS:
        engines[name] = e = LLMEngine(EngineConfig(
            model=path, max_num_seqs=max(args.batch), kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
            max_num_batched_tokens=args.prefill_prompts * args.prompt_len,
            fuse_projections=name != "unfused"))
        if name == "fused-every-size":
            for layer in e.model.layers:
                layer.self_attn.qkv_proj.max_rows = layer.mlp.gate_up_proj.max_rows = 1 << 30

    prefill = {k: [] for k in VARIANTS}
    for rep in range(args.repeats + 1):          # the first round warms up shapes
        for name in VARIANTS[rep % 3:] + VARIANTS[:rep % 3]:
            eng = engines[name]
            _add(eng, f"p{rep}", args.prefill_prompts, args.prompt_len, 1)
            mx.synchronize()
            t = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            mx.synchronize()
            if rep:
                prefill[name].append((time.perf_counter() - t) * 1e3)
            eng.kv.cache.reset()

    decode = {b: {k: [] for k in VARIANTS} for b in args.batch}
    for b in args.batch:
        for eng in engines.values():
            _add(eng, f"d{b}", b, args.prompt_len, 10 * args.steps * (args.repeats + 1))
            while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for s in eng.scheduler.running):
                eng.step()
        for rep in range(args.repeats):
            for name in VARIANTS[rep % 3:] + VARIANTS[:rep % 3]:
                eng = engines[name]
                for _ in range(3):
                    eng.step()
                mx.synchronize()
                t = time.perf_counter()
                for _ in range(args.steps):
                    eng.step()
                mx.synchronize()
                decode[b][name].append((time.perf_counter() - t) / args.steps * 1e3)
        for eng in engines.values():
            _drain(eng)

    rows = [{"variant": k, "kind": "prefill", "tokens": args.prefill_prompts * args.prompt_len,
             "ms": float(np.median(prefill[k])), "runs_ms": prefill[k]} for k in VARIANTS]
    rows += [{"variant": k, "kind": "decode", "batch": b, "ms": float(np.median(decode[b][k])),
              "runs_ms": decode[b][k]} for b in args.batch for k in VARIANTS]
    print(f"{'step':>18} | " + " | ".join(f"{k:>16}" for k in VARIANTS) + " | fused / unfused")
    for label, sel in [(f"prefill {args.prefill_prompts}x{args.prompt_len}", lambda r: r["kind"] == "prefill")] + \
            [(f"decode batch {b}", lambda r, b=b: r.get("batch") == b) for b in args.batch]:
        ms = {r["variant"]: r["ms"] for r in rows if sel(r)}
        print(f"{label:>18} | " + " | ".join(f"{ms[k]:>13.2f} ms" for k in VARIANTS) +
              f" | {ms['fused'] / ms['unfused']:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "device": str(mx.default_device()),
                                          "mlx": mx.__version__, "rows": rows}, indent=2))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
