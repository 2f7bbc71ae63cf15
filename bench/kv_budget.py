"""What happens when KV memory runs out: the same closed loop of requests on ever
smaller KV pools, down to a fraction of what the engine holds at peak with room to
spare. A dense cache holds every running sequence at its batch's padded length and has
nothing to give back when memory is short; the paged pool preempts the lowest-priority
running sequence (its blocks freed, its tokens recomputed later), and every request
should still complete with the same greedy tokens. mlx-lm's `BatchGenerator` (the
batcher `mlx_lm.server` runs) on the same requests gives the dense cache's peak for
scale.

In-process, one `LLMEngine` per pool size, the same requests each time. Each row:
throughput, TTFT, preemptions, whether every request's tokens match the roomy run's,
and the blocks still held once all requests are done (0: nothing leaked).
Writes `bench/results/kv_budget_<tag>.json` and `.png`.

    python bench/kv_budget.py                                      # CPU, embedded model
    python bench/kv_budget.py --model llama-1b --tag gpu --streams 128 --prompt-len 512 \\
        --gen-len 128 --requests 384 --roomy-kv-gb 16
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import (  # noqa: E402
    RESULTS, resolve_model, run_meta, run_mlx_lm, run_ours, workload)

from runtime import EngineConfig, LLMEngine  # noqa: E402


def run_budget(model: str, reqs, streams: int, num_blocks: int | None, roomy_bytes: int) -> tuple[dict, dict]:
    """One engine on a pool of `num_blocks` (None: `roomy_bytes`), run to completion: its
    row and each request's tokens."""
    cfg = EngineConfig(model=model, max_num_seqs=streams,
                       **({"num_gpu_blocks": num_blocks} if num_blocks else {"kv_cache_memory_bytes": roomy_bytes}))
    engine = LLMEngine(cfg)
    finals: dict[int, list[int]] = {}
    row = run_ours(engine, reqs, streams, "ours", finals=finals)
    s = engine.stats()
    engine.close()
    row.update(num_blocks=s["num_total_blocks"], kv_bytes_pool=s["kv_cache_bytes_total"],
               kv_bytes_peak=s["kv_cache_bytes_peak"], preemptions=s["preemptions"],
               completed=len(finals), blocks_held_after=s["num_blocks_held_by_requests"],
               bytes_per_block=s["kv_cache_bytes_total"] // s["num_total_blocks"], block_size=s["block_size"])
    return row, finals


def plot(rows: list[dict], dense_peak: float | None, path: Path, title: str) -> None:
    """Against KV bytes: each small pool's size, and for the roomy run the peak it held."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    pts = sorted(((r["kv_bytes_peak"] if r["fraction_of_peak"] is None else r["kv_bytes_pool"]) / 2**20, r)
                 for r in rows)
    mib = [m for m, _ in pts]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    ax[0].plot(mib, [r["output_tok_s"] for _, r in pts], marker="o", label="ours: output tok/s")
    ax[0].set_ylim(bottom=0)
    ax[1].plot(mib, [r["ttft_p95_s"] for _, r in pts], marker="o", label="ours: TTFT p95")
    ax[1].plot(mib, [r["ttft_p50_s"] for _, r in pts], marker="o", label="ours: TTFT p50")
    twin = ax[1].twinx()
    twin.bar(mib, [r["preemptions"] for _, r in pts], width=[m * 0.06 for m in mib], alpha=0.3, color="red")
    twin.set_ylabel("preemptions (bars)")
    for a in ax:
        if dense_peak:
            a.axvline(dense_peak / 2**20, color="grey", linestyle=":", label="mlx-lm's dense cache, peak")
        a.set(xscale="log", xlabel="KV pool (MiB; the largest of ours: the roomy run's peak)")
        ticks = mib + ([dense_peak / 2**20] if dense_peak else [])
        a.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
        a.xaxis.set_minor_formatter(NullFormatter())     # log-axis minor labels overlap
        a.legend(fontsize=8)
    ax[0].set(ylabel="output tok/s", title="Throughput vs KV pool")
    ax[1].set(ylabel="seconds", title="TTFT and preemptions vs KV pool")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _title(meta: dict) -> str:
    a = meta["args"]
    return f"{meta['model']} on {meta['device']}: {a['streams']} streams, {a['requests']} requests"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default', 'llama-1b' (random, bf16) or a path")
    ap.add_argument("--tag", default="cpu", help="results go to kv_budget_<tag>.json/png")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=128, help="mean; each prompt 1/4 to 7/4 of it")
    ap.add_argument("--gen-len", type=int, default=64, help="mean; each output 1/4 to 7/4 of it")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.75, 0.5, 0.35, 0.25],
                    help="pool sizes, as fractions of the roomy run's peak")
    ap.add_argument("--roomy-kv-gb", type=float, default=1.0, help="the roomy run's pool: must not preempt")
    ap.add_argument("--no-dense", action="store_true", help="skip mlx-lm's BatchGenerator")
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--replot", action="store_true", help="only redo the plot from the JSON")
    args = ap.parse_args(argv)
    out = Path(args.results_dir) / f"kv_budget_{args.tag}.json"
    if args.replot:
        done = json.loads(out.read_text())
        dense = done["dense_mlx_lm"]
        plot(done["rows"], dense["kv_bytes_peak"] if dense else None, out.with_suffix(".png"), _title(done["meta"]))
        return

    model = resolve_model(args.model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    spec = argparse.Namespace(fixed=False, prompt_len=args.prompt_len, gen_len=args.gen_len)
    reqs = workload(args.requests, spec, vocab, seed=0)
    roomy_bytes = int(args.roomy_kv_gb * 2**30)
    roomy, want = run_budget(model, reqs, args.streams, None, roomy_bytes)
    if roomy["preemptions"]:
        raise SystemExit(f"the roomy pool preempted {roomy['preemptions']} times: raise --roomy-kv-gb")
    roomy.update(pool="roomy", fraction_of_peak=None, requests_matching_roomy=len(want))
    rows = [roomy]
    per_block, block_size = roomy["bytes_per_block"], roomy["block_size"]
    peak_blocks = roomy["kv_bytes_peak"] // per_block
    need_one = max(-(-(len(p) + g) // block_size) for p, g in reqs)   # the engine refuses less
    for f in args.fractions:
        n = max(need_one, int(f * peak_blocks))
        row, got = run_budget(model, reqs, args.streams, n, roomy_bytes)
        row.update(pool=f"{f:g} of the roomy peak", fraction_of_peak=n / peak_blocks,
                   requests_matching_roomy=sum(got.get(i) == t for i, t in want.items()))
        rows.append(row)
    dense = None
    if not args.no_dense:
        from mlx_lm import load

        plain, _ = load(model)
        kv: list[int] = []
        dense = run_mlx_lm(plain, reqs, args.streams, on_step=lambda g: kv.append(g.prompt_cache_nbytes))
        dense["kv_bytes_peak"] = float(max(kv))

    print(f"\n{args.requests} requests, {args.streams} streams; pool MiB, tok/s, TTFT p50/p95, preemptions, "
          f"requests done, matching the roomy run, blocks held after")
    for r in rows:
        print(f"  {r['pool']:>22} {r['kv_bytes_pool'] / 2**20:8.2f} {r['output_tok_s']:8.1f} "
              f"{r['ttft_p50_s'] * 1e3:8.1f} {r['ttft_p95_s'] * 1e3:8.1f} {r['preemptions']:5d} "
              f"{r['completed']:4d} {r['requests_matching_roomy']:4d} {r['blocks_held_after']:3d}")
    if dense:
        print(f"  {'mlx-lm BatchGenerator':>22} peak KV {dense['kv_bytes_peak'] / 2**20:.2f} MiB, "
              f"{dense['output_tok_s']:.1f} tok/s, TTFT p50 {dense['ttft_p50_s'] * 1e3:.1f} ms")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = run_meta(args)
    out.write_text(json.dumps({"meta": meta, "dense_mlx_lm": dense, "rows": rows}, indent=1))
    try:
        plot(rows, dense["kv_bytes_peak"] if dense else None, out.with_suffix(".png"), _title(meta))
    except ImportError:
        print("matplotlib is not installed: no plot")
    print(f"wrote {out}")

if __name__ == "__main__":
    main()
