"""Static batching vs our continuous batching vs mlx-lm's `BatchGenerator`, one process.

Each system serves the same closed-loop workload: `streams` clients, each sending
its next request as soon as the previous one finishes, `--requests-per-stream` each.
Prompts and outputs have mixed lengths (or fixed ones with `--fixed`). EOS is ignored,
so every request produces exactly its output length. Reported per system and stream
count: output tok/s, TTFT p50/p95 and peak memory, plus ratios against mlx-lm. Peak
memory is the process's MLX peak during the run: the weights, our engines' KV pools
(allocated up front, whichever system runs) and activations, so it compares runs, not
the systems' KV footprints (`bench/compare.py` measures those).

    python bench/bench_continuous_vs_static.py                     # embedded model, CPU-sized
    python bench/bench_continuous_vs_static.py --model llama-1b --fixed \\
        --prompt-len 512 --gen-len 128 --streams 1 8 32 64 128 256   # the GPU run
"""

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from runtime.models import default_model_path  # noqa: E402
from runtime.models.tiny import make_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

# A random-weight model shaped like Llama-3.2-1B (bf16), for the GPU measurements.
LLAMA_1B = dict(arch="llama", hidden=2048, layers=16, heads=32, kv_heads=8, vocab_size=128256,
                intermediate=8192, dtype="bfloat16", context=8192)


COMPILE = {"auto": None, "on": True, "off": False}


def portable_args(args: dict) -> dict:
    """A run's arguments as a result file records them: without the results folder, a
    path of this machine."""
    return {k: v for k, v in args.items() if k != "results_dir"}


def run_meta(args) -> dict:
    """What a result file records of the run: model, device, platform, MLX, the
    arguments (`portable_args`) and the `MLX_*` settings MLX read from the environment
    (graph sizes, caches: runs that set them are not comparable with runs that did not)."""
    meta = {"model": args.model, "device": str(mx.default_device()), "platform": platform.platform(),
            "mlx": mx.__version__, "args": portable_args(vars(args))}
    mlx_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}
    if mlx_env:
        meta["mlx_env"] = mlx_env
    return meta


def write_result(results_dir: str, name: str, out) -> Path:
    """Write a benchmark's JSON as `results_dir/name` and say where."""
    path = Path(results_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print("wrote", path)
    return path


def resolve_model(name: str) -> str:
    if name == "default":
        return str(default_model_path())
    if name == "llama-1b":
        out = Path(tempfile.gettempdir()) / "mlx-paged-serve-llama-1b-v2"
        if not (out / "config.json").exists():
            make_model_fast(out, **LLAMA_1B)
        return str(out)
    return name


def make_model_fast(out: Path, vocab_size: int, **spec) -> None:
    """Like `make_model`, but with the big vocabulary set straight in the config: a
    BPE trained to 128k merges on our small corpus is impossible, and the weights'
    shapes are all the benchmark needs. Token ids above the tokenizer's are fine."""
    make_model(out, vocab_size=512, **{**spec, "tie": True})
    from mlx_lm.utils import _get_classes, save_config, save_model
    cfg = json.loads((out / "config.json").read_text())
    cfg["vocab_size"] = vocab_size
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    model.set_dtype(getattr(mx, spec.get("dtype", "float32")))
    mx.eval(model.parameters())
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_model(out, model)
    save_config(cfg, out / "config.json")


def workload(n_requests: int, args, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n_requests):
        if args.fixed:
            p, g = args.prompt_len, args.gen_len
        else:
            p = rng.randint(max(1, args.prompt_len // 4), args.prompt_len * 7 // 4)
            g = rng.randint(max(1, args.gen_len // 4), args.gen_len * 7 // 4)
        reqs.append(([rng.randrange(3, vocab) for _ in range(p)], g))
    return reqs


def summarize(name, streams, reqs, ttfts, total_out, wall, peak):
    t = np.array(ttfts)
    return {
        "system": name, "streams": streams, "requests": len(reqs),
        "output_tokens": total_out, "wall_s": wall,
        "output_tok_s": total_out / wall,
        "ttft_p50_s": float(np.percentile(t, 50)), "ttft_p95_s": float(np.percentile(t, 95)),
        "peak_memory_gb": peak / 1e9,
    }


def median_row(runs: list[dict]) -> dict:
    """Median of each figure over repeated runs; `runs_output_tok_s` keeps them all."""
    out = dict(runs[0])
    for key in ("output_tok_s", "ttft_p50_s", "ttft_p95_s", "wall_s", "peak_memory_gb"):
        out[key] = float(np.median([r[key] for r in runs]))
    out["runs_output_tok_s"] = [r["output_tok_s"] for r in runs]
    return out


def run_ours(engine: LLMEngine, reqs, streams: int, name: str, on_step=None, finals: dict | None = None,
             params=None):
    """`finals`: filled with each request's generated token ids, by its index in `reqs`.
    `params(i, max_tokens)`: request i's `SamplingParams` (default: greedy, EOS ignored)."""
    pending = list(enumerate(reqs))
    submit, first, out_tokens = {}, {}, 0
    mx.reset_peak_memory()
    t0 = time.perf_counter()

    def launch():
        i, (prompt, gen) = pending.pop(0)
        rid = f"b{i}"
        sp = params(i, gen) if params else SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
        sp.output_kind = "delta"   # as a server streams
        engine.add_request(rid, None, sp, prompt_token_ids=prompt)
        submit[rid] = time.perf_counter()

    for _ in range(min(streams, len(pending))):
        launch()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if on_step:
            on_step()
        for o in outputs:
            now = time.perf_counter()
            first.setdefault(o.request_id, now)
            if o.finished:
                out_tokens += len(o.outputs[0].token_ids)
                if finals is not None:
                    finals[int(o.request_id[1:])] = list(o.outputs[0].token_ids)
                if pending:
                    launch()
    wall = time.perf_counter() - t0
    ttfts = [first[r] - submit[r] for r in submit]
    return summarize(name, streams, reqs, ttfts, out_tokens, wall, mx.get_peak_memory())


def run_mlx_lm(model, reqs, streams: int, on_step=None):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=max(streams, 1),
                         prefill_batch_size=min(8, streams))
    pending = list(reqs)
    submit, first, out_tokens = {}, {}, 0
    mx.reset_peak_memory()
    t0 = time.perf_counter()

    def launch():
        prompt, g = pending.pop(0)
        (uid,) = gen.insert([prompt], [g])
        submit[uid] = time.perf_counter()

    for _ in range(min(streams, len(pending))):
        launch()
    while responses := gen.next_generated():
        if on_step:
            on_step(gen)
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now)
            out_tokens += 1
            if r.finish_reason is not None and pending:
                launch()
    wall = time.perf_counter() - t0
    gen.close()
    ttfts = [first[u] - submit[u] for u in submit]
    return summarize("mlx_lm.BatchGenerator", streams, reqs, ttfts, out_tokens, wall, mx.get_peak_memory())


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s (read + write), measured here and now."""
    a = mx.zeros((nbytes // 4,), mx.float32)
    mx.eval(a)
    mx.eval(a + 1)
    t = time.perf_counter()
    for _ in range(5):
        mx.eval(a + 1)
    return 2 * nbytes * 5 / (time.perf_counter() - t)


def add_roofline(row: dict, weight_bytes: int, kv_bytes_per_token: int, args, bandwidth: float) -> None:
    """Fraction of the memory roofline a decode-bound run reached: each step reads the
    weights once and every running sequence's KV; bytes/step x steps/s vs `bandwidth`."""
    batch = row["streams"]
    mean_ctx = args.prompt_len + args.gen_len / 2
    step_bytes = weight_bytes + batch * mean_ctx * kv_bytes_per_token
    steps_per_s = row["output_tok_s"] / batch
    row["bytes_per_step"] = step_bytes
    row["roofline_fraction"] = step_bytes * steps_per_s / bandwidth


def single_stream_vs_generate_step(engine: LLMEngine, model, args) -> dict:
    """Decode tok/s of one request, ours vs mlx-lm's `generate_step`, both warm."""
    from mlx_lm.generate import generate_step

    prompt = workload(1, argparse.Namespace(fixed=True, prompt_len=args.prompt_len, gen_len=1),
                      model.args.vocab_size, seed=7)[0][0]
    n = args.gen_len

    def ours():
        engine.kv.cache.reset()
        t0 = time.perf_counter()
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        return len(out.outputs[0].token_ids) / (time.perf_counter() - t0)

    def theirs():
        t0 = time.perf_counter()
        k = 0
        for _ in generate_step(mx.array(prompt), model, max_tokens=n):
            k += 1
        return k / (time.perf_counter() - t0)

    ours(), theirs()
    o = float(np.median([ours() for _ in range(3)]))
    g = float(np.median([theirs() for _ in range(3)]))
    return {"prompt_len": args.prompt_len, "gen_len": n, "ours_tok_s": o,
            "mlx_lm_generate_step_tok_s": g, "ratio": o / g}


SYSTEM_NAMES = {"ours-continuous": "ours", "mlx_lm.BatchGenerator": "mlx-lm", "ours-static": "static"}


def flat_rows(rows: list[dict], single: dict | None, meta: dict) -> list[dict]:
    """One row per (system, streams) with the fixed field names; the single-stream
    comparison rides on the `ours` row at one stream."""
    out = []
    for r in rows:
        row = {**r, "system": SYSTEM_NAMES.get(r["system"], r["system"]), "label": r["system"], "meta": meta}
        if single and row["system"] == "ours" and row["streams"] == 1:
            row.update(single_stream_tok_s=single["ours_tok_s"],
                       generate_step_tok_s=single["mlx_lm_generate_step_tok_s"],
                       single_stream_ratio=single["ratio"])
        out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default', 'llama-1b' (random, bf16) or a path")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--fixed", action="store_true", help="all prompts and outputs the same length")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--compile-decode", choices=["auto", "on", "off"], default="auto",
                    help="decode steps through mx.compile (auto: with the CUDA kernel)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per point; the median is reported")
    ap.add_argument("--single-stream", action="store_true",
                    help="also compare one request's decode with mlx-lm's generate_step")
    ap.add_argument("--systems", nargs="+", default=["static", "continuous", "mlx_lm"])
    ap.add_argument("--out", default=str(RESULTS / "continuous_vs_static_cpu.json"))
    ap.add_argument("--rows-out", default=None,
                    help="also write a flat JSON list of rows, systems named ours / mlx-lm / static")
    args = ap.parse_args(argv)

    path = resolve_model(args.model)
    top = max(args.streams)
    cfg = dict(model=path, max_num_seqs=max(top, 1), max_num_batched_tokens=args.max_num_batched_tokens,
               kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30), attention_backend=args.attention_backend,
               compile_decode=COMPILE[args.compile_decode])
    engines = {}
    if "continuous" in args.systems:
        engines["continuous"] = LLMEngine(EngineConfig(**cfg))
    if "static" in args.systems:
        engines["static"] = LLMEngine(EngineConfig(**cfg, enable_continuous_batching=False))
    # mlx-lm runs its own copy of the model, as loaded: the engines fuse projections.
    from mlx_lm import load
    model, _ = load(path)
    vocab = model.args.vocab_size
    warm = workload(4, argparse.Namespace(fixed=True, prompt_len=32, gen_len=8), vocab, seed=99)
    for name, eng in engines.items():
        run_ours(eng, warm, 4, name)
    if "mlx_lm" in args.systems:
        run_mlx_lm(model, warm, 4)

    rows = []
    for streams in args.streams:
        reqs = workload(streams * args.requests_per_stream, args, vocab, seed=streams)
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):          # systems interleaved, so drift hits all alike
            for name in args.systems:
                if name == "mlx_lm":
                    row = run_mlx_lm(model, reqs, streams)
                else:
                    eng = engines[name]
                    eng.kv.cache.reset()           # no warm prefix cache across runs
                    row = run_ours(eng, reqs, streams, f"ours-{name}")
                runs.setdefault(name, []).append(row)
        for name in args.systems:
            row = median_row(runs[name])
            rows.append(row)
            print(f"{row['system']:>24} streams={streams:<4} {row['output_tok_s']:9.1f} tok/s  "
                  f"TTFT p50 {row['ttft_p50_s']:.3f}s p95 {row['ttft_p95_s']:.3f}s  "
                  f"peak {row['peak_memory_gb']:.2f} GB", flush=True)

    from mlx.utils import tree_flatten
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    kv_per_token = 0
    if engines:
        eng = next(iter(engines.values()))
        kv_per_token = eng.runner.pool.bytes_per_block // eng.config.block_size
    bandwidth = copy_bandwidth()
    for r in rows:
        add_roofline(r, weight_bytes, kv_per_token, args, bandwidth)
    single = single_stream_vs_generate_step(engines["continuous"], model, args) \
        if args.single_stream and "continuous" in engines else None

    print()
    hdr = (f"{'streams':>7} | {'system':>24} | {'out tok/s':>10} | {'vs mlx-lm':>9} | {'TTFT p50':>9} | "
           f"{'TTFT p95':>9} | {'peak GB':>7} | {'roofline':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ref = next((x for x in rows if x["streams"] == r["streams"] and x["system"].startswith("mlx_lm")), None)
        ratio = r["output_tok_s"] / ref["output_tok_s"] if ref else float("nan")
        r["throughput_vs_mlx_lm"] = ratio
        print(f"{r['streams']:>7} | {r['system']:>24} | {r['output_tok_s']:>10.1f} | {ratio:>8.2f}x | "
              f"{r['ttft_p50_s']:>8.3f}s | {r['ttft_p95_s']:>8.3f}s | {r['peak_memory_gb']:>7.2f} | "
              f"{r['roofline_fraction']:>7.1%}")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, weights {weight_bytes / 1e9:.2f} GB")
    if single:
        print(f"single stream: ours {single['ours_tok_s']:.1f} tok/s, mlx-lm generate_step "
              f"{single['mlx_lm_generate_step_tok_s']:.1f} tok/s ({single['ratio']:.2f}x)")

    meta = {"model": args.model, "device": str(mx.default_device()), "platform": platform.platform(),
            "mlx": mx.__version__, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "fixed": args.fixed, "requests_per_stream": args.requests_per_stream,
            "repeats": args.repeats, "max_num_batched_tokens": args.max_num_batched_tokens,
            "attention_backend": next(iter(engines.values())).runner.attention_backend if engines else None,
            "compile_decode": any(e.runner.decode_graph is not None for e in engines.values())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta.update(copy_bandwidth_bytes_s=bandwidth, weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "single_stream": single}, indent=2))
    print(f"\nwrote {args.out}")
    if args.rows_out:
        Path(args.rows_out).write_text(json.dumps(flat_rows(rows, single, meta), indent=2))
        print(f"wrote {args.rows_out}")
    return rows


if __name__ == "__main__":
    main()
