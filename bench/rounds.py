"""Systems side by side, round after round, on one host.

`compare.py` runs one system after another, so a host whose speed drifts (this 2-core
machine's yardstick has moved 2x within one system's run) lands on whichever system
ran then. Here every system is started once and stays up (idle while another one is
measured); each round measures every point on every system, in an order rotated each
round, and every measurement draws fresh prompts (a repeated prompt would hit a prefix
cache) of the same lengths for every system in that round (TTFT follows the prompt's
length). Ratios are taken within a round and the median over rounds is reported.
Writes `bench/results/rounds_<tag>.json`.

    python bench/rounds.py --rounds 5        # 2-core CPU host: about 12 minutes

Points: random-length requests at each `--concurrency`, and Poisson arrivals at
`--rate` (default: 80 % of mlx_lm.server's peak in `compare_<tag>.json`'s sweep; gamma
arrivals with `--burstiness` other than 1, as in `serve_bench.py`).
"""

import argparse
import json
import math
import os
import random
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import compare  # noqa: E402
from bench import serve_bench as sb  # noqa: E402
from bench.bench_continuous_vs_static import run_meta  # noqa: E402

ANCHOR = "mlx_lm.server"


def points(args) -> list[dict]:
    pts = [{"point": f"{c} streams", "concurrency": c, "rate": None, "n": max(args.min_prompts, 2 * c)}
           for c in args.concurrency]
    return pts + [{"point": "Poisson", "concurrency": None, "rate": args.rate, "n": args.poisson_prompts}]


def start(name: str, stack: ExitStack, model: str, engine: dict, extra: dict, top: int) -> compare.Target:
    if name == ANCHOR:
        return stack.enter_context(compare.mlx_lm_server(model, top, extra))
    if name == "ours":
        return stack.enter_context(compare.ours(model, engine, "ours", extra))
    if name == "ours-bare-engine":
        return stack.enter_context(compare.bare_engine(model, engine, extra))
    if (v := compare.app_variant(name)) is not None:   # compare.VARIANTS
        return stack.enter_context(v.app(model, engine, name, extra))
    raise SystemExit(f"unknown system {name!r}: {ANCHOR}, ours, ours-bare-engine, ours-chunks-N or "
                     f"{', '.join(compare.VARIANTS)}")


def paired(rows: list[dict], point: str, a: str, b: str, key: str, op) -> float | None:
    """Median over rounds of op(a's figure, b's figure) within each round."""
    vals = []
    for r in sorted({x["round"] for x in rows}):
        got = {x["system"]: x for x in rows if x["round"] == r and x["point"] == point and not x["failed"]}
        if a in got and b in got and got[a][key] is not None and got[b][key] is not None:
            vals.append(op(got[a][key], got[b][key]))
    return statistics.median(vals) if vals else None


def summarize(rows: list[dict], systems: list[str]) -> dict:
    out, ok = {}, [x for x in rows if not x["failed"]]
    for p in dict.fromkeys(x["point"] for x in rows):
        s = {name: {k: statistics.median(x[k] for x in ok if x["point"] == p and x["system"] == name)
                    for k in ("output_tok_s", "ttft_p50_s", "tpot_p50_s")}
             for name in systems if any(x["point"] == p and x["system"] == name for x in ok)}
        if ANCHOR in systems and "ours" in systems:
            s["ttft_p50_ratio_ours_over_mlx_lm"] = paired(rows, p, "ours", ANCHOR, "ttft_p50_s", lambda a, b: a / b)
        if "ours-bare-engine" in systems and "ours" in systems:
            s["serve_throughput_cost"] = paired(rows, p, "ours", "ours-bare-engine", "output_tok_s",
                                                lambda a, b: 1 - a / b)
            s["serve_ttft_p50_added_s"] = paired(rows, p, "ours", "ours-bare-engine", "ttft_p50_s",
                                                 lambda a, b: a - b)
        for name in systems:   # a variant of the app against the app as shipped
            if compare.app_variant(name) is not None and "ours" in systems:
                v = name.removeprefix("ours-")
                s[f"{v}_ttft_p50_change_s"] = paired(rows, p, name, "ours", "ttft_p50_s", lambda a, b: a - b)
                s[f"{v}_throughput_ratio"] = paired(rows, p, name, "ours", "output_tok_s", lambda a, b: a / b)
            if compare.app_variant(name) is not None and "ours-bare-engine" in systems:
                v = name.removeprefix("ours-")
                s[f"{v}_serve_throughput_cost"] = paired(rows, p, name, "ours-bare-engine", "output_tok_s",
                                                         lambda a, b: 1 - a / b)
                s[f"{v}_serve_ttft_p50_added_s"] = paired(rows, p, name, "ours-bare-engine", "ttft_p50_s",
                                                          lambda a, b: a - b)
        for name in systems:   # where our TTFT goes: in the replica (request, first_token), outside it
            split = [x["ttft_split_p50_s"] for x in ok if x["point"] == p and x["system"] == name
                     and x.get("ttft_split_p50_s")]
            if split:
                s[f"{name}_ttft_split_p50_s"] = {k: statistics.median(x[k] for x in split) for k in split[0]}
        out[p] = s
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--systems", nargs="+", default=[ANCHOR, "ours", "ours-bare-engine"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    ap.add_argument("--burstiness", type=float, default=1.0, help="their gamma shape (1: Poisson)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--poisson-prompts", type=int, default=96)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--results-dir", default=str(compare.RESULTS))
    args = ap.parse_args(argv)
    if not args.burstiness > 0:
        ap.error(f"--burstiness must be > 0, got {args.burstiness}")
    results = Path(args.results_dir)
    if args.rate is None:
        bundle = json.loads((results / f"compare_{args.tag}.json").read_text())
        args.rate = round(compare.poisson_rate(bundle, args.output_len)[0], 3)

    from mlx_lm.utils import load_tokenizer

    model = compare.resolve_model(args.model)
    tok = load_tokenizer(Path(model))
    extra = sb.eos_logit_bias(tok)
    engine = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "kv_cache_memory_bytes": int(args.kv_cache_gb * 2**30)}
    warm = SimpleNamespace(concurrency=sorted({*args.concurrency, 16}), input_len=args.input_len,
                           range_ratio=args.range_ratio)
    rows = []
    out = results / f"rounds_{args.tag}.json"
    meta = {**run_meta(args), "cpus": os.cpu_count()}

    def save() -> dict:
        """Written after every round, so a run stopped early keeps the rounds it finished."""
        summary = summarize(rows, args.systems)
        out.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
        return summary

    with ExitStack() as stack:
        targets = [start(name, stack, model, engine, extra, args.max_num_seqs) for name in args.systems]
        for t in targets:
            compare.warm_up(t, compare.Workloads(tok, warm))
        for r in range(args.rounds):
            order = targets[r % len(targets):] + targets[:r % len(targets)]
            for i, p in enumerate(points(args)):
                for j, t in enumerate(order):
                    # Text of its own (nothing cached from another system's turn), and the
                    # same lengths as the other systems' in this round: TTFT follows the
                    # prompt's length, and 16 draws from 64-192 tokens differ by more
                    # than the effects measured.
                    reqs = sb.random_workload(sb.TextSource(tok, 100_000 * (r + 1) + 1000 * i + j), p["n"],
                                              args.input_len, args.output_len, args.range_ratio,
                                              lengths=random.Random(100_000 * (r + 1) + 1000 * i))
                    s = compare.measure(t, reqs, p["rate"] or math.inf, p["concurrency"], seed=r,
                                        burstiness=args.burstiness if p["rate"] else 1.0)
                    rows.append(compare.to_row(t, p["point"], s, round=r, point=p["point"],
                                               burstiness=s["burstiness"]))
            save()

    summary = save()
    print("\nmedian over rounds:")
    for p, s in summary.items():
        for k, v in s.items():
            print(f"  {p:>10} {k:>34}: " + (", ".join(f"{a} {b:.4g}" for a, b in v.items())
                                            if isinstance(v, dict) else f"{v:.4g}" if v is not None else "n/a"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
