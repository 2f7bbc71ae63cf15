"""Niceness under Ray, side by side on one `serve run`.

Ray starts its workers at nice 15, and the replica and its engine process ran there;
`LLMServer` moves both back to `engine_nice` (0). This runs the shipped app once and
alternates one of them (`--target engine`: the engine process; `--target replica`: the
replica's process, its engine staying at 0) between nice 15 and nice 0 (`--levels`: any
two), every thread of it (root, or CAP_SYS_NICE, to go back to 0 or below), round after
round, the order swapped each round, so a host whose speed drifts moves both alike. Every measurement draws its own
prompts from the same distribution: repeated prompts would be prefix-cache hits for
whichever ran second. Writes `bench/results/<target>_nice_<tag>.json`.

    python bench/engine_nice_ab.py --rounds 3                              # about 12 minutes
    python bench/engine_nice_ab.py --rounds 3 --target replica --streams 4  # about 5 minutes
"""

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from bench import serve_bench as sb  # noqa: E402
from bench.compare import Target, measure  # noqa: E402
from deployments.llm_server import renice_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NICE = (15, 0)   # Ray's, and LLMServer's default engine_nice


def points(args) -> list[dict]:
    return [{"name": "1 stream", "concurrency": 1, "rate": None, "n": 24},
            {"name": "Poisson", "concurrency": None, "rate": args.rate, "n": 96},
            {"name": f"{args.streams} streams", "concurrency": args.streams, "rate": None, "n": 3 * args.streams}]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rate", type=float, default=4.5, help="Poisson arrivals, requests/s")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--target", choices=["engine", "replica"], default="engine")
    ap.add_argument("--levels", type=int, nargs=2, default=list(NICE), metavar=("A", "B"),
                    help="the two niceness levels alternated (below 0 needs root)")
    args = ap.parse_args(argv)
    levels = tuple(args.levels)

    from mlx_lm.utils import load_tokenizer

    from runtime.models import default_model_path
    from tests.serving import ServeRun, engine_pids, replica_pids

    tok = load_tokenizer(default_model_path())
    extra = sb.eos_logit_bias(tok)
    apps = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())["applications"]
    run = ServeRun(apps)
    rows = []
    try:
        (replica,) = replica_pids(apps[0]["name"])
        (engine,) = engine_pids(replica)

        target = Target("ours", lambda: sb.HTTPBackend(run.urls[apps[0]["name"]], "default", extra))
        measure(target, sb.random_workload(sb.TextSource(tok, 99), 16, args.input_len, 8, 0.5), concurrency=8)
        for r in range(args.rounds):
            for i, p in enumerate(points(args)):
                for nice in (levels if r % 2 == 0 else levels[::-1]):
                    reqs = sb.random_workload(sb.TextSource(tok, 1000 * r + 100 * i + nice), p["n"],
                                              args.input_len, args.output_len, 0.5)
                    pid = engine if args.target == "engine" else replica
                    if renice_process(nice, pid) != nice:
                        raise SystemExit(f"could not renice {args.target} {pid} to {nice} (needs root)")
                    s = measure(target, reqs, p["rate"] or math.inf, p["concurrency"], seed=r)
                    row = {"round": r, "point": p["name"], f"{args.target}_nice": nice, "concurrency": p["concurrency"],
                           "request_rate": p["rate"], "output_tok_s": s["output_throughput"],
                           "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p95_s": s["ttft_s"]["p95"],
                           "tpot_p50_s": s["tpot_s"]["p50"], "completed": s["completed"], "failed": s["failed"],
                           "cached_prompt_tokens": s["cached_prompt_tokens"]}
                    rows.append(row)
                    print(f"round {r} {p['name']:>11} nice {nice:>2}: {row['output_tok_s']:6.1f} tok/s  "
                          f"TTFT p50 {row['ttft_p50_s'] * 1e3:7.1f} ms  TPOT p50 {row['tpot_p50_s'] * 1e3:6.1f} ms  "
                          f"cached {row['cached_prompt_tokens']}",
                          flush=True)
    finally:
        run.stop()

    summary = {}
    for p in points(args):
        for nice in levels:
            mine = [x for x in rows if x["point"] == p["name"] and x[f"{args.target}_nice"] == nice]
            summary[f"{p['name']}, nice {nice}"] = {
                k: statistics.median(x[k] for x in mine) for k in ("output_tok_s", "ttft_p50_s", "tpot_p50_s")}
    print("\nmedian over rounds:")
    for k, v in summary.items():
        print(f"  {k:>20}: {v['output_tok_s']:6.1f} tok/s  TTFT p50 {v['ttft_p50_s'] * 1e3:7.1f} ms  "
              f"TPOT p50 {v['tpot_p50_s'] * 1e3:6.1f} ms")
    out = ROOT / "bench" / "results" / f"{args.target}_nice_{args.tag}.json"
    out.write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "summary": summary, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
