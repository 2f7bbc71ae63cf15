"""What a step hands MLX: the primitives in its graph, by type, and how long queuing it takes.

A step on a GPU is host-bound when queuing it (`mx.async_eval`: MLX walks the graph and
encodes a kernel, or a view, per primitive) takes longer than the device needs to run
it. This counts the primitives of the steps a prefix hit meets: decode steps (through
the compiled decode graph, if the engine has one, then eagerly) and a hit's first step
(its suffix prefill beside the decodes), with the milliseconds each spent queuing, the
median over `--repeats`. "views" are the primitives that move no data (reshapes,
transposes, squeezes and the like); most come from the model's (tokens, 1, features)
layout and from MLX's matmul flattening a 3-D input. On MLX's CPU backend the fast ops
(RMSNorm, RoPE) expand to their reference graphs, so its counts run higher.

    python bench/step_ops.py --model llama-1b --prefix-len 2048 --suffix-len 64 --streams 4
"""

import argparse
import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import RESULTS, resolve_model, run_meta, write_result  # noqa: E402
import mlx.core as mx  # noqa: E402

from runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

VIEWS = {"Reshape", "Transpose", "Flatten", "Unflatten", "Squeeze", "ExpandDims", "Broadcast", "Slice",
         "AsStrided", "Split"}


def primitives(arrays: list[mx.array]) -> collections.Counter:
    """The primitives of the graph that computes `arrays`, by type."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.read()))


class Recorder:
    """Wraps the runner's `queue`: each step's primitives and queuing time, filed under
    the kind of step the caller says is next."""

    def __init__(self, engine: LLMEngine):
        self.kind = None
        self.steps: dict[str, list[tuple[collections.Counter, float, int]]] = collections.defaultdict(list)
        self._queue = engine.runner.queue
        engine.runner.queue = self

    def __call__(self, pending):
        if self.kind is None:
            return self._queue(pending)
        res = pending.result
        counts = primitives([a for a in (res.arrays() if res is not None else []) if a is not None])
        t = time.perf_counter()
        self._queue(pending)
        took = (time.perf_counter() - t) * 1e3
        mx.synchronize()   # its device time stays out of the next step's queuing
        self.steps[self.kind].append((counts, took, pending.num_tokens))


def run(engine: LLMEngine, rec: Recorder | None, args, prefix: list[int], salt: int) -> None:
    """Decodes running, then hits arriving one at a time among them."""
    long = SamplingParams(temperature=0, max_tokens=8 * args.repeats + 16, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"d{salt}-{i}", None, long, prompt_token_ids=[salt * 97 + i + 3] * 32)
    for _ in range(3):
        engine.step()

    def steps(kind: str, n: int) -> None:
        for _ in range(n):
            if rec is not None:
                rec.kind = kind
            engine.step()
        if rec is not None:
            rec.kind = None

    graph = engine.runner.decode_graph
    if graph is not None:
        steps("decode (compiled)", args.repeats)
    engine.runner.decode_graph = None
    steps("decode (eager)", args.repeats)
    engine.runner.decode_graph = graph
    for r in range(args.repeats):
        engine.add_request(f"h{salt}-{r}", None, one, prompt_token_ids=prefix + [salt + r + 3] * args.suffix_len)
        steps("hit: suffix prefill beside the decodes", 1)
        engine.step()
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--streams", type=int, default=4, help="decoding sequences beside each hit")
    ap.add_argument("--repeats", type=int, default=5, help="steps of each kind measured")
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--results-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=resolve_model(args.model), max_num_seqs=max(8, args.streams + 1),
                                    kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30)))
    prefix = list(range(3, 3 + args.prefix_len))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.generate([prefix], one)                            # the prefix cached
    run(engine, None, args, prefix, 1)                        # every shape met once (kernels, plans)
    rec = Recorder(engine)
    run(engine, rec, args, prefix, 2)
    rows = []
    print(f"{engine.runner.attention_backend} attention, {mx.default_device()}, "
          f"{len(engine.runner.caches)} layers")
    print(f"{'step':>38} | {'tokens':>6} | {'primitives':>10} | {'views':>5} | {'queue ms p50':>12} | top types")
    for kind, steps in rec.steps.items():
        counts, ms, tokens = steps[-1][0], statistics.median(s[1] for s in steps), steps[-1][2]
        total, views = sum(counts.values()), sum(n for k, n in counts.items() if k in VIEWS)
        rows.append({"step": kind, "tokens": tokens, "primitives": total, "views": views,
                     "queue_ms_p50": ms, "queue_ms": [s[1] for s in steps], "by_type": dict(counts.most_common())})
        top = ", ".join(f"{k} {n}" for k, n in counts.most_common(6))
        print(f"{kind:>38} | {tokens:>6} | {total:>10} | {views:>5} | {ms:>12.2f} | {top}")
    write_result(args.results_dir, f"step_ops_{args.tag}.json",
                 {**run_meta(args), "attention_backend": engine.runner.attention_backend,
                  "layers": len(engine.runner.caches), "rows": rows})


if __name__ == "__main__":
    main()
