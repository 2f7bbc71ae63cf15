"""Where a decode step's time goes: host work vs waiting for the device.

For each batch size, fills the engine with that many sequences, lets prefill finish,
then times decode steps: the wall time per step, the time spent blocked on the device
(waiting for the step in flight before queueing the next, reading back sampled
tokens: the device-bound share), and the rest (host: scheduling, metadata, graph
building, kernel encoding, detokenizing); and token processing on its own (`tokens ms`,
on whichever thread runs it). `--cprofile` adds the top host functions; `--served-outputs every|due` makes delta
outputs as a server asks for them, every step or only when due (a paced stream).

    python bench/step_profile.py --model llama-1b --batch 1 32 128 256
"""

import argparse
import cProfile
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_continuous_vs_static import COMPILE, RESULTS, resolve_model  # noqa: E402
from bench.step_clock import StepClock, top_functions  # noqa: E402
import mlx.core as mx  # noqa: E402

from runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def profile(engine: LLMEngine, batch: int, prompt_len: int, steps: int, use_cprofile: bool,
            served_outputs: str | None = None):
    """`served_outputs`: outputs as a server asks for them, deltas, made "every" step or
    only when "due" (a stream paced past the run's end: `LLMEngine.output_wanted`);
    None: whole outputs every step."""
    vocab = engine.vocab_size
    for i in range(batch):
        ids = [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(prompt_len)]
        params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
        if served_outputs:
            params.output_kind = "delta"
        engine.add_request(f"p{batch}-{i}", None, params, prompt_token_ids=ids)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    # The host blocks on the device in two places, both under "wait": waiting for the
    # step in flight before queueing the next one, and reading back sampled tokens.
    # Token processing (detokenizing, stop checks, making outputs; "process") is timed
    # on whichever thread runs it: host work that is the same on any device.
    clock = StepClock(engine)
    engine.output_wanted = (lambda request_id: False) if served_outputs == "due" else None
    prof = cProfile.Profile() if use_cprofile else None
    if prof:
        prof.enable()
    mx.synchronize()
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    t0 = time.perf_counter()
    for _ in range(steps):
        clock.step()
    wall = time.perf_counter() - t0
    mx.synchronize()
    # A step that copied the pool instead of updating it in place would need a
    # second buffer of a whole layer's pool array.
    extra = mx.get_peak_memory() - active
    if prof:
        prof.disable()
    clock.close()
    engine.output_wanted = None
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    waited = clock.total("wait")
    row = {"batch": batch, "step_ms": wall / steps * 1e3, "wait_ms": waited / steps,
           "host_ms": (wall * 1e3 - waited) / steps, "process_ms": clock.total("process") / steps,
           "tok_s": batch * steps / wall,
           "peak_over_active_mb": extra / 2**20, "pool_layer_array_mb": engine.runner.pool.keys[0].nbytes / 2**20}
    if prof:
        row["top"] = top_functions(prof, steps, 12)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sync", action="store_true", help="turn off async scheduling")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--compile-decode", choices=["auto", "on", "off"], default="auto",
                    help="decode steps through mx.compile (auto: with the CUDA kernel)")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--served-outputs", choices=["every", "due"], default=None,
                    help="delta outputs as a server asks for them, made every step or only when due")
    ap.add_argument("--out", default=str(RESULTS / "step_profile.json"))
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=resolve_model(args.model), max_num_seqs=max(args.batch),
                                    max_num_batched_tokens=8192, async_scheduling=not args.sync,
                                    kv_cache_memory_bytes=8 << 30,
                                    attention_backend=args.attention_backend,
                                    compile_decode=COMPILE[args.compile_decode]))
    print("attention backend:", engine.runner.attention_backend)
    rows = [profile(engine, b, args.prompt_len, args.steps, args.cprofile, args.served_outputs)
            for b in [args.batch[0]] + args.batch]
    rows = rows[1:]   # the first pass warms up kernels
    print(f"{'batch':>6} | {'step ms':>8} | {'device wait ms':>14} | {'host ms':>8} | {'tokens ms':>9} | "
          f"{'tok/s':>9} | {'peak over active MiB':>20} (pool layer array {rows[0]['pool_layer_array_mb']:.0f} MiB)")
    for r in rows:
        print(f"{r['batch']:>6} | {r['step_ms']:>8.2f} | {r['wait_ms']:>14.2f} | {r['host_ms']:>8.2f} | "
              f"{r['process_ms']:>9.2f} | {r['tok_s']:>9.1f} | {r['peak_over_active_mb']:>20.1f}")
        for name, ms in r.get("top", []):
            print(f"{'':>8}{ms:8.3f} ms  {name}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "sync": args.sync, "served_outputs": args.served_outputs,
                                          "compile_decode": engine.runner.decode_graph is not None,
                                          "attention_backend": engine.runner.attention_backend,
                                          "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
