"""Plot `bench_continuous_vs_static.py` results: output tok/s and TTFT p50 vs streams.

    python bench/plot_results.py bench/results/continuous_vs_static_gpu.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(path: Path) -> Path:
    data = json.loads(path.read_text())
    rows = data["rows"]
    systems = sorted({r["system"] for r in rows})
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for s in systems:
        pts = sorted((r["streams"], r["output_tok_s"], r["ttft_p50_s"]) for r in rows if r["system"] == s)
        xs = [p[0] for p in pts]
        a.plot(xs, [p[1] for p in pts], marker="o", label=s)
        b.plot(xs, [p[2] for p in pts], marker="o", label=s)
    meta = data.get("meta", {})
    title = f"{meta.get('model', '')} on {meta.get('device', '')}, prompt {meta.get('prompt_len')}, gen {meta.get('gen_len')}"
    for ax, ylabel in ((a, "output tok/s"), (b, "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("wrote", plot(Path(p)))
