"""Where a benchmark's CPU goes, process by process (Linux: reads /proc).

Runs a command, samples every process's CPU time once a second while it runs, and
reports the 10-second window in which our engine process was busiest (the load's
steady part, past start-up and warm-up), with every process's share of one core in
that same window, and the engine process's threads' shares: its main thread (the engine
loop: scheduling, building each step, queuing it) and the others by CPU, the busiest
being MLX's CPU stream, where the step's arrays are computed. Each run is added to
`--out` under `--label`.

    python bench/process_cpu.py --label bare --rows-from /tmp/compare_pcpu.json -- python bench/compare.py \\
        --systems ours-bare-engine --concurrency 16 --workloads random --min-prompts 320 --no-kv-memory \\
        --tag pcpu --results-dir /tmp
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import RESULTS  # noqa: E402

WINDOW_S = 10.0
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_name(argv: list[str]) -> str:
    """A name without this machine's paths: Ray's worker title, or the program and the
    script or module it runs."""
    if len(argv) == 1 and not argv[0].startswith("ray::"):
        argv = argv[0].split()      # a title set over the whole command line
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split(".")[0]
    prog = os.path.basename(argv[0])
    if prog.startswith("python"):
        for i, a in enumerate(argv[1:], 1):
            if a == "-m" and i + 1 < len(argv):
                return f"python -m {argv[i + 1]}"
            if a == "-c":
                return "python -c"
            if not a.startswith("-"):
                return f"python {os.path.basename(a)}"
    return prog


def cpu_ticks(stat: str) -> int:
    """User and system CPU ticks from a /proc `stat` line (the name in brackets may hold spaces)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def snapshot() -> dict[int, tuple[int, str]]:
    """pid -> (CPU ticks, user and system, of all its threads; its name)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        out[int(pid)] = (cpu_ticks(stat), process_name([a for a in argv if a]))
    return out


def thread_ticks(pids: list[int]) -> dict[int, tuple[int, str]]:
    """tid -> (CPU ticks, "main" for a process's own thread, else "other"), of `pids`' threads."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            out[int(tid)] = (cpu_ticks(stat), "main" if tid == str(pid) else "other")
    return out


def busiest_window(samples: list[tuple[float, dict, dict]], engine: str) -> tuple[dict, list]:
    """Per-process share of one core (%) in the window where `engine` was busiest, and
    the engine's threads' shares there: (label, %), the main thread first, then the
    others, busiest first."""
    best = None
    for i, (t0, a, ta) in enumerate(samples):
        j = next((j for j in range(i + 1, len(samples)) if samples[j][0] - t0 >= WINDOW_S), None)
        if j is None:
            break
        t1, b, tb = samples[j]
        rates: dict[str, float] = {}
        for pid, (ticks, name) in b.items():
            if pid in a:
                rates[name] = rates.get(name, 0.0) + (ticks - a[pid][0]) / TICKS / (t1 - t0) * 100
        threads = [(label, (ticks - ta[tid][0]) / TICKS / (t1 - t0) * 100)
                   for tid, (ticks, label) in tb.items() if tid in ta]
        threads.sort(key=lambda t: (t[0] != "main", -t[1]))
        key = rates.get(engine, 0.0)
        if best is None or key > best[0]:
            best = (key, rates, threads)
    return (best[1], best[2]) if best else ({}, [])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True)
    ap.add_argument("--engine", default="python -m runtime.engine_process")
    ap.add_argument("--out", default=str(RESULTS / "process_cpu.json"))
    ap.add_argument("--rows-from", default=None,
                    help="a compare.py JSON the command writes: its rows' headline figures join the run's record")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    proc = subprocess.Popen(cmd)
    samples = []
    while proc.poll() is None:
        now = snapshot()
        samples.append((time.monotonic(), now, thread_ticks([p for p, (_, n) in now.items() if n == args.engine])))
        time.sleep(1.0)
    if proc.returncode:
        sys.exit(f"the command failed ({proc.returncode})")
    rates, threads = busiest_window(samples, args.engine)
    procs = sorted(({"process": n, "cpu_pct": round(r, 1)} for n, r in rates.items() if r >= 0.5),
                   key=lambda p: -p["cpu_pct"])
    for p in procs:
        print(f"{p['cpu_pct']:7.1f} %  {p['process']}")
    total = round(sum(rates.values()), 1)
    print(f"{total:7.1f} %  all processes, of {os.cpu_count() * 100} %")
    engine_threads = [{"thread": label, "cpu_pct": round(r, 1)} for label, r in threads if r >= 0.5]
    print("engine threads:", ", ".join(f"{t['thread']} {t['cpu_pct']} %" for t in engine_threads))
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"window_s": WINDOW_S, "runs": []}
    data["runs"] = [r for r in data["runs"] if r["label"] != args.label]
    run = {"label": args.label, "command": " ".join(os.path.basename(c) if os.sep in c else c for c in cmd),
           "cores": os.cpu_count(), "total_cpu_pct": total, "processes": procs, "engine_threads": engine_threads}
    if args.rows_from:
        keys = ("system", "workload", "concurrency", "output_tok_s", "ttft_p50_s", "tpot_p50_s")
        run["rows"] = [{k: r.get(k) for k in keys} for r in json.loads(Path(args.rows_from).read_text())]
    data["runs"].append(run)
    out.write_text(json.dumps(data, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
