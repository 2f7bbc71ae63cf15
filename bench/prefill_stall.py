"""What a long prompt arriving costs the streams already running: chunked prefill
mixed into decode steps, against the whole prompt in one step, against mlx-lm's
`BatchGenerator` (the batcher `mlx_lm.server` runs), which prefills new prompts in a
pass of their own while its running sequences wait.

In-process. `--streams` requests decode (short prompts, long outputs); once each has
a few tokens, one `--long-prompt`-token prompt arrives. Each row: the long prompt's
TTFT, the running streams' inter-token gaps before it arrived (median) and while it
prefilled (the largest), and how many tokens each running stream got meanwhile (the
fewest). Our engine runs with a token budget of each `--budgets` (the prompt enters
that many tokens a step, beside the decodes) and with one budget holding the whole
prompt (`unchunked`). Writes `bench/results/prefill_stall_<tag>.json`.

    python bench/prefill_stall.py                                  # CPU, embedded model
    python bench/prefill_stall.py --model llama-1b --tag gpu --streams 32 --long-prompt 7680 \\
        --budgets 512 2048
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import RESULTS, resolve_model, run_meta  # noqa: E402

from runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

WARM_TOKENS = 8     # tokens each running stream has before the long prompt arrives
LONG = "long"


class Clock:
    """Token arrival times per stream, and when the long prompt arrived and began."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}
        self.counts: dict[str, int] = {}
        self.arrived = self.first = None

    def tokens(self, stream: str, n: int, now: float) -> None:
        if n:
            self.times.setdefault(stream, []).append(now)
            self.counts[stream] = self.counts.get(stream, 0) + n

    def warm(self, streams: list[str]) -> bool:
        return all(self.counts.get(s, 0) >= WARM_TOKENS for s in streams)

    def row(self, system: str, streams: list[str], **extra) -> dict:
        before, during, got = [], [], []
        for s in streams:
            t = self.times[s]
            gaps = list(zip(t, t[1:]))
            before += [b - a for a, b in gaps if b <= self.arrived]
            during += [b - a for a, b in gaps if b > self.arrived and a < self.first]
            got.append(sum(1 for x in t if self.arrived < x <= self.first))
        return {"system": system, "long_ttft_s": self.first - self.arrived,
                "gap_before_p50_s": statistics.median(before), "gap_during_max_s": max(during),
                "tokens_during_min": min(got), **extra}


def run_ours(model: str, prompts: list[list[int]], long: list[int], gen: int, budget: int | None) -> dict:
    """`budget` None: one budget holds the whole long prompt (no chunking)."""
    whole = len(long) + len(prompts)
    cfg = EngineConfig(model=model, max_num_seqs=len(prompts) + 1, max_num_batched_tokens=budget or whole,
                       enable_chunked_prefill=budget is not None, kv_cache_memory_bytes=1 << 30)
    engine = LLMEngine(cfg)
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True, output_kind="delta")
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, params, prompt_token_ids=p)
    clock, streams, steps = Clock(), [str(i) for i in range(len(prompts))], 0
    while clock.first is None:
        if clock.arrived is None and clock.warm(streams):
            engine.add_request(LONG, None, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                               prompt_token_ids=long)
            clock.arrived, steps = time.perf_counter(), 0
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            if o.request_id == LONG:
                clock.first = now
            else:
                clock.tokens(o.request_id, len(o.outputs[0].delta_token_ids), now)
    for r in list(engine.requests):
        engine.abort(r)
    engine.close()
    name = f"ours, budget {budget}" if budget else "ours, unchunked"
    return clock.row(name, streams, budget=budget or whole, steps_until_first_token=steps)


def run_mlx_lm(model: str, prompts: list[list[int]], long: list[int], gen: int) -> dict:
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    plain, _ = load(model)
    gen_ = BatchGenerator(plain, completion_batch_size=len(prompts) + 1, prefill_batch_size=len(prompts))
    uids = gen_.insert(prompts, [gen] * len(prompts))
    streams = [str(u) for u in uids]
    clock, long_uid = Clock(), None
    while clock.first is None:
        if long_uid is None and clock.warm(streams):
            (long_uid,) = gen_.insert([long], [1])
            clock.arrived = time.perf_counter()
        responses = gen_.next_generated()
        now = time.perf_counter()
        for r in responses:
            if r.uid == long_uid:
                clock.first = now
            else:
                clock.tokens(str(r.uid), 1, now)
    gen_.close()
    return clock.row("mlx-lm BatchGenerator", streams, prefill_step_size=2048)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default', 'llama-1b' (random, bf16) or a path")
    ap.add_argument("--tag", default="cpu", help="results go to prefill_stall_<tag>.json")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-prompt", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=3072)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 2048],
                    help="token budgets a step (2,048: configs/config.yaml's)")
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--results-dir", default=str(RESULTS))
    args = ap.parse_args(argv)

    model = resolve_model(args.model)
    config = json.loads((Path(model) / "config.json").read_text())
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(3, config["vocab_size"]) for _ in range(n)]  # noqa: E731
    prompts = [tokens(args.stream_prompt) for _ in range(args.streams)]
    long = tokens(args.long_prompt)
    # The running streams outlast the measurement, which then aborts them.
    gen = config["max_position_embeddings"] - args.stream_prompt
    rows = [run_ours(model, prompts, long, gen, b) for b in [*args.budgets, None]]
    if not args.no_mlx_lm:
        rows.append(run_mlx_lm(model, prompts, long, gen))
    print(f"\n{args.streams} streams decoding, then a {args.long_prompt}-token prompt:")
    print(f"{'system':>24} {'long TTFT':>10} {'gap before p50':>15} {'gap during max':>15} {'tokens during':>14}")
    for r in rows:
        print(f"{r['system']:>24} {r['long_ttft_s'] * 1e3:8.1f}ms {r['gap_before_p50_s'] * 1e3:13.1f}ms "
              f"{r['gap_during_max_s'] * 1e3:13.1f}ms {r['tokens_during_min']:14d}")
    out = Path(args.results_dir) / f"prefill_stall_{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = run_meta(args)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
