"""Prefix-cache hit waves, with and without prefill attention plans built while idle.

Replays what `compare.py`'s prefix workload does to the engine: four 2048-token
prefixes, a cold wave of 8 prompts, one hit wave of 8 arriving at once (what a
warm-up would run), then measured hit waves of 8 prompts (prefix + 63 new tokens)
whose arrival is split over steps, as a closed loop of streams splits them: 1 then 7,
2 then 6, and so on. Each split meets the same padded prefill shape at another batch
size. With `idle`, the engine builds its queued plans between the warm-up and the
measured waves (`LLMEngine.idle_work`); with `none`, it does not. Each mode runs in a
process of its own (MLX keeps plans per process and thread), on the same model.
Reported per wave: the time until its last prompt's first token.

    python bench/prefill_plans.py --model llama-1b
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import RESULTS, resolve_model  # noqa: E402

SPLITS = [[1, 7], [2, 6], [3, 5], [4, 4], [5, 3], [6, 2], [7, 1], [1, 1, 6], [2, 2, 4], [8]]


def run_mode(args) -> dict:
    import mlx.core as mx
    import numpy as np

    from runtime import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=resolve_model(args.model), max_num_seqs=256,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30)))
    if engine.runner.prefill_plans is None:      # off CUDA: pad as CUDA does, to compare like with like
        engine.runner.pad_prefill_shapes()
    rng = np.random.default_rng(0)
    hi = min(engine.vocab_size, 30000)
    prefixes = [rng.integers(3, hi, args.prefix_len).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    count = [0]

    def wave(split: list[int]) -> float:
        t0, first, ids = time.perf_counter(), {}, []

        def step():
            for o in engine.step():
                first.setdefault(o.request_id, time.perf_counter() - t0)

        for j, k in enumerate(split):
            for i in range(k):
                ids.append(f"r{count[0]}")
                count[0] += 1
                engine.add_request(ids[-1], None, params, prompt_token_ids=prefixes[(i + j) % 4]
                                   + rng.integers(3, hi, args.suffix_len).tolist())
            if j < len(split) - 1:
                step()                              # the rest arrive a step later
        while any(r not in first for r in ids):
            step()
        while engine.has_unfinished_requests():
            engine.step()
        return max(first[r] for r in ids)

    cold = wave([8])
    warm = wave([8])
    t = time.perf_counter()
    plans = engine.runner.prefill_plans
    queued = plans.pending
    if args.mode == "idle":
        while engine.has_idle_work():
            engine.idle_work()
    mx.synchronize()
    idle_s = time.perf_counter() - t
    waves = [{"split": s, "ttft_last_s": wave(s)} for s in SPLITS]
    return {"mode": args.mode, "cold_wave_s": cold, "warm_up_wave_s": warm, "plans_queued": queued,
            "idle_build_s": idle_s if args.mode == "idle" else 0.0, "waves": waves,
            "device": str(mx.default_device()), "mlx": mx.__version__}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=63)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--kv-cache-gb", type=float, default=16.0)
    ap.add_argument("--tag", default=None, help="results file suffix (default: the device kind)")
    ap.add_argument("--order", nargs=2, choices=["idle", "none"], default=["none", "idle"],
                    help="which mode runs first (MLX's on-disk kernel cache warms the second)")
    ap.add_argument("--mode", choices=["idle", "none"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    runs = {}
    for mode in args.order:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs[mode] = json.loads(out.strip().splitlines()[-1])
    none, idle = runs["none"], runs["idle"]
    print(f"plans queued after the warm-up wave: {idle['plans_queued']}, "
          f"built while idle in {idle['idle_build_s'] * 1e3:.0f} ms")
    print(f"{'split':>10} {'no idle plans':>14} {'idle plans':>11} {'ratio':>6}")
    for a, b in zip(none["waves"], idle["waves"]):
        print(f"{'+'.join(map(str, a['split'])):>10} {a['ttft_last_s'] * 1e3:>11.1f} ms "
              f"{b['ttft_last_s'] * 1e3:>8.1f} ms {a['ttft_last_s'] / b['ttft_last_s']:>5.2f}x")
    tot = [sum(w["ttft_last_s"] for w in r["waves"]) for r in (none, idle)]
    print(f"{'sum':>10} {tot[0] * 1e3:>11.1f} ms {tot[1] * 1e3:>8.1f} ms {tot[0] / tot[1]:>5.2f}x")
    tag = args.tag or ("gpu" if "gpu" in idle["device"] else "cpu")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"prefill_plans_{tag}.json"
    path.write_text(json.dumps({"args": vars(args) | {"mode": None}, "runs": runs}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
