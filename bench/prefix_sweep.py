"""Prefix-repetition TTFT against the shared prefix's length, APC on and off: where the
prefix cache pays and by how much. `compare.py` measures one length; a hit's cost
(Serve's hops, a step for its few new tokens) hardly grows with the prefix while a
miss's prefill does, so the ratio is a function of the length, not one number.

Systems, one after another, each started once and measured at every length in turn:
the app (`ours`) and the app with the prefix cache off (`ours-no-apc`), the bare engine
with the cache on and off (`ours-bare-engine`, `ours-bare-engine-no-apc`: the same ratio
without Serve's hops), and `mlx_lm.server` (its own prompt cache). Every length draws
text of its own, so nothing cached at one length is hit at another; each length's
shapes are warmed up first (a cold wave, then hits), as in `compare.py`.
Writes `bench/results/prefix_sweep_<tag>.json` and `.png`.

    python bench/prefix_sweep.py                                    # CPU, embedded model
    python bench/prefix_sweep.py --model llama-1b --tag gpu --prefix-lens 1024 2048 4096 7680 \\
        --suffix-len 64 --prefix-prompts 64 --prefix-concurrency 8 --kv-cache-gb 16 \\
        --max-num-batched-tokens 16384
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import compare  # noqa: E402
from bench import serve_bench as sb  # noqa: E402
from bench.bench_continuous_vs_static import run_meta  # noqa: E402

SYSTEMS = ("ours", "ours-no-apc", "ours-bare-engine", "ours-bare-engine-no-apc", "mlx_lm.server")
# (cache on, cache off): the ratio through Serve, and the engine's own.
PAIRS = {"apc_speedup": ("ours", "ours-no-apc"),
         "apc_speedup_bare_engine": ("ours-bare-engine", "ours-bare-engine-no-apc")}
TARGET = 5.0


def start(name: str, model: str, engine: dict, extra: dict, top: int):
    """The context manager that runs system `name`."""
    no_apc = {**engine, "enable_prefix_caching": False}
    if name == "ours":
        return compare.ours(model, engine, name, extra)
    if name == "ours-no-apc":
        return compare.ours(model, no_apc, name, extra)
    if name == "ours-bare-engine":
        return compare.bare_engine(model, engine, extra)
    if name == "ours-bare-engine-no-apc":
        return compare.bare_engine(model, no_apc, extra, name)
    if name == "mlx_lm.server":
        return compare.mlx_lm_server(model, top, extra)
    raise SystemExit(f"unknown system {name!r}: {', '.join(SYSTEMS)}")


def workload(tok, a, prefix_len: int, seed: int):
    return sb.prefix_workload(sb.TextSource(tok, seed + prefix_len), a.prefix_prompts, prefix_len,
                              a.num_prefixes, a.suffix_len, a.prefix_output_len)


def warm_up(target, tok, a, prefix_len: int) -> None:
    """`compare.warm_up`'s prefix passes at this length, on text of their own."""
    for c in compare.warm_prefix_concurrency(a.prefix_concurrency):
        reqs = sb.prefix_workload(sb.TextSource(tok, 90_000 + prefix_len), 2 * c, prefix_len, a.num_prefixes,
                                  a.suffix_len, a.prefix_output_len)
        compare.measure(target, reqs, concurrency=c)


def summarize(rows: list[dict]) -> dict:
    """Per prefix length: each system's TTFT p50, and each pair's off / on ratio."""
    out = {}
    for n in sorted({r["prefix_len"] for r in rows}):
        at = {r["system"]: r for r in rows if r["prefix_len"] == n and not r["failed"]}
        s = {f"{name}_ttft_p50_s": r["ttft_p50_s"] for name, r in at.items()}
        for key, (on, off) in PAIRS.items():
            if on in at and off in at:
                s[key] = at[off]["ttft_p50_s"] / at[on]["ttft_p50_s"]
        out[str(n)] = s
    return out


def plot(rows: list[dict], summary: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    lens = sorted({r["prefix_len"] for r in rows})
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["system"] for r in rows):
        pts = sorted((r["prefix_len"], r["ttft_p50_s"] * 1e3) for r in rows if r["system"] == name and not r["failed"])
        ax[0].plot(*zip(*pts), marker="o", label=name, linestyle="--" if name.endswith("no-apc") else "-")
    ax[0].set(xscale="log", yscale="log", xlabel="shared prefix (tokens)", ylabel="TTFT p50 (ms)",
              title="Prefix-repetition TTFT p50")
    for key, (on, _) in PAIRS.items():
        pts = sorted((int(n), s[key]) for n, s in summary.items() if key in s)
        if pts:
            ax[1].plot(*zip(*pts), marker="o", label=f"{on}: cache off / on")
    ax[1].plot([lens[0], lens[-1]], [TARGET, TARGET], color="grey", linestyle=":", label=f"{TARGET:g}x")
    ax[1].set(xscale="log", xlabel="shared prefix (tokens)", ylabel="TTFT p50, off / on",
              title="What the prefix cache saves")
    for a in ax:
        a.set_xticks(lens, [str(n) for n in lens])
        a.xaxis.set_minor_formatter(NullFormatter())     # log-axis minor labels overlap
        a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _title(model: str, device: str) -> str:
    return f"{model} on {device} ({platform.machine()})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default', 'llama-1b' (random, bf16) or a path")
    ap.add_argument("--tag", default="cpu", help="results go to prefix_sweep_<tag>.json/png")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--prefix-lens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--prefix-output-len", type=int, default=16)
    ap.add_argument("--prefix-prompts", type=int, default=48)
    ap.add_argument("--prefix-concurrency", type=int, default=4)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--graph-prefill-tokens", type=int, default=0,
                    help="the engines' graph_prefill_tokens (prefill chunks in the compiled decode graph)")
    ap.add_argument("--results-dir", default=str(compare.RESULTS))
    ap.add_argument("--replot", action="store_true", help="only redo the plot from the JSON")
    args = ap.parse_args(argv)
    out = Path(args.results_dir) / f"prefix_sweep_{args.tag}.json"
    if args.replot:
        done = json.loads(out.read_text())
        meta = done["meta"]
        plot(done["rows"], done["summary"], out.with_suffix(".png"), _title(meta["model"], meta["device"]))
        return

    from mlx_lm.utils import load_tokenizer

    model = compare.resolve_model(args.model)
    tok = load_tokenizer(Path(model))
    extra = sb.eos_logit_bias(tok)
    engine = {"max_num_seqs": max(64, args.prefix_concurrency), "max_num_batched_tokens": args.max_num_batched_tokens,
              "kv_cache_memory_bytes": int(args.kv_cache_gb * 2**30)}
    if args.graph_prefill_tokens:
        engine["graph_prefill_tokens"] = args.graph_prefill_tokens
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**run_meta(args), "host": {}}
    rows: list[dict] = []

    def save() -> dict:
        summary = summarize(rows)
        out.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
        return summary

    for name in args.systems:
        t0, ticks0, speed0 = time.perf_counter(), compare.cpu_ticks(), compare.host_speed()
        with start(name, model, engine, extra, args.prefix_concurrency) as target:
            for n in args.prefix_lens:
                warm_up(target, tok, args, n)
                s = compare.measure(target, workload(tok, args, n, 3000), concurrency=args.prefix_concurrency)
                rows.append(compare.to_row(target, "prefix", s, prefix_len=n, num_prefixes=args.num_prefixes))
                save()
        meta["host"][name] = compare.host_during(ticks0, speed0)
        print(f"-- {name}: {time.perf_counter() - t0:.0f} s", flush=True)

    summary = save()
    print("\nTTFT p50 by prefix length (ms), and cache off / on:")
    for n, s in summary.items():
        print(f"  {n:>6}: " + "  ".join(f"{k.removesuffix('_ttft_p50_s')} {v * 1e3:.1f}" for k, v in s.items()
                                        if k.endswith("_ttft_p50_s"))
              + "".join(f"  {k} {s[k]:.2f}x" for k in PAIRS if k in s))
    try:
        plot(rows, summary, out.with_suffix(".png"), _title(args.model, meta["device"]))
    except ImportError:
        print("matplotlib is not installed: no plot")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
