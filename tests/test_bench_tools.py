"""The smaller benchmarks: `process_cpu` names processes without this machine's paths
and reads the window where the engine was busiest; `mixed_prefill` runs end to end and
restores the shipped grouping after its other arm; `prefix_sweep` gives each length text
of its own and hits the cache only with it on; `kv_budget` preempts on small pools and
still completes every request with the roomy run's tokens; `kv_sharing` computes a shared
prefix once; `prefill_stall` keeps running streams decoding while a chunked prompt enters;
`hit_profile` hits the cache in its hit pass only; `loop_profile` times hits through each
driver; `shape_plans` counts the row grid; `step_ops` counts each kind of step's
primitives; `sliding_window` times a windowed layer's ways, which agree; `moe_determinism`
runs each of its ways of mlx-lm's forward, which on the CPU are the CPU's."""

import json
import os
import sys

from bench import (buffer_cache, hit_profile, kv_budget, kv_sharing, loop_profile, mixed_prefill, moe_determinism,
                   prefill_stall, prefix_sweep, process_cpu, shape_plans, sliding_window, step_ops, step_profile,
                   structured_output)
from runtime.attention import KERNELS, available, metadata


def test_process_names_carry_no_paths():
    name = process_cpu.process_name
    assert name(["/opt/py/bin/python3.11", "-m", "runtime.engine_process", "5"]) == "python -m runtime.engine_process"
    assert name(["/opt/py/bin/python3.11", "-u", "/opt/site/ray/log_monitor.py", "--x"]) == "python log_monitor.py"
    assert name(["/opt/py/bin/python3.11 -u /opt/site/ray/dashboard.py --flag"]) == "python dashboard.py"
    assert name(["python3", "-c", "import sys; sys.path = ['/opt/site']"]) == "python -c"
    assert name(["ray::ServeReplica:llm:OpenAIServer.handle_request"]) == "ray::ServeReplica:llm:OpenAIServer"
    assert name(["/opt/site/ray/core/src/ray/raylet/raylet", "--port=1"]) == "raylet"


def test_busiest_window_is_the_engines_and_sums_by_name():
    """The window is the one where the engine was busiest; processes of one name add up;
    the engine's threads come main first, then the others busiest first."""
    tick = process_cpu.TICKS
    engine = "python -m runtime.engine_process"
    samples = [(float(t), {1: (int(e * tick), engine), 2: (int(p * tick), "ray::ProxyActor"),
                           3: (int(p * tick), "ray::ProxyActor")},
                {1: (int(m * tick), "main"), 7: (int(c * tick), "other"), 8: (0, "other")})
               for t, e, p, m, c in ((0, 0, 0, 0, 0), (10, 2, 1, 1, 1), (20, 12, 1, 2, 10), (30, 13, 2, 3, 10))]
    rates, threads = process_cpu.busiest_window(samples, engine)
    assert abs(rates[engine] - 100.0) < 1e-6 and rates["ray::ProxyActor"] == 0.0
    assert [label for label, _ in threads] == ["main", "other", "other"]
    assert [round(r, 6) for _, r in threads] == [10.0, 90.0, 0.0]
    assert process_cpu.busiest_window(samples[:1], engine) == ({}, [])


def test_thread_ticks_reads_this_process_with_its_main_thread():
    ticks = process_cpu.thread_ticks([os.getpid()])
    assert ticks[os.getpid()][1] == "main" and all(t >= 0 for t, _ in ticks.values())


def test_process_cpu_records_a_command(tmp_path):
    out, rows = tmp_path / "cpu.json", tmp_path / "rows.json"
    rows.write_text(json.dumps([{"system": "s", "workload": "w", "concurrency": 1, "output_tok_s": 2.0,
                                 "ttft_p50_s": 0.1, "tpot_p50_s": 0.01, "extra": 1}]))
    process_cpu.main(["--label", "x", "--out", str(out), "--rows-from", str(rows), "--",
                      sys.executable, "-c", "import time; time.sleep(1.5)"])
    (run,) = json.loads(out.read_text())["runs"]
    assert run["label"] == "x" and run["rows"] == [{"system": "s", "workload": "w", "concurrency": 1,
                                                   "output_tok_s": 2.0, "ttft_p50_s": 0.1, "tpot_p50_s": 0.01}]
    assert "/" not in run["command"].split(" -c ")[0]


def test_mixed_prefill_runs_both_groupings_and_restores_the_shipped_one(tmp_path):
    shipped = metadata.query_class
    out = tmp_path / "mixed.json"
    mixed_prefill.main(["--prefix-len", "160", "--suffix-len", "8", "--hits", "2", "--rounds", "1",
                        "--num-prefixes", "1", "--kv-cache-gb", "0.05", "--out", str(out)])
    assert metadata.query_class is shipped
    rows = json.loads(out.read_text())["rows"]
    assert [r["grouping"] for r in rows] == list(mixed_prefill.ARMS)
    assert all(r["wave_ms"] > 0 and len(r["samples_ms"]["wave"]) == 1 for r in rows)


def test_prefix_sweep_lengths_share_no_text():
    from types import SimpleNamespace

    from mlx_lm.utils import load_tokenizer
    from runtime.models import default_model_path

    tok = load_tokenizer(default_model_path())
    a = SimpleNamespace(prefix_prompts=4, num_prefixes=2, suffix_len=4, prefix_output_len=2)
    short = {r.prompt[:40] for r in prefix_sweep.workload(tok, a, 64, 3000)}
    long = {r.prompt[:40] for r in prefix_sweep.workload(tok, a, 128, 3000)}
    assert len(short) == len(long) == 2 and not short & long


def test_prefix_sweep_summary_pairs_cache_off_over_on():
    rows = [{"system": s, "prefix_len": n, "ttft_p50_s": t, "failed": 0}
            for s, n, t in (("ours", 512, 0.1), ("ours-no-apc", 512, 0.6), ("ours-bare-engine", 512, 0.05),
                            ("ours", 1024, 0.1), ("ours-no-apc", 1024, 1.2))]
    s = prefix_sweep.summarize(rows)
    assert abs(s["512"]["apc_speedup"] - 6.0) < 1e-9 and "apc_speedup_bare_engine" not in s["512"]
    assert abs(s["1024"]["apc_speedup"] - 12.0) < 1e-9 and s["1024"]["ours_ttft_p50_s"] == 0.1


def test_prefix_sweep_runs_the_bare_engine_with_the_cache_on_and_off(tmp_path):
    prefix_sweep.main(["--systems", "ours-bare-engine", "ours-bare-engine-no-apc", "--prefix-lens", "48", "96",
                       "--prefix-prompts", "6", "--prefix-concurrency", "2", "--num-prefixes", "2",
                       "--kv-cache-gb", "0.05", "--results-dir", str(tmp_path)])
    out = json.loads((tmp_path / "prefix_sweep_cpu.json").read_text())
    got = {(r["system"], r["prefix_len"]): r for r in out["rows"]}
    assert set(got) == {(s, n) for s in ("ours-bare-engine", "ours-bare-engine-no-apc") for n in (48, 96)}
    for n in (48, 96):
        on, off = got["ours-bare-engine", n], got["ours-bare-engine-no-apc", n]
        assert on["completed"] == off["completed"] == 6
        # Two streams can miss a prefix together at most once each: at least two of the
        # six hit, on every whole block short of the prefix's last token.
        assert on["cached_prompt_tokens"] >= 2 * 16 * ((n - 1) // 16) and off["cached_prompt_tokens"] == 0
        assert out["summary"][str(n)]["apc_speedup_bare_engine"] > 0
    assert (tmp_path / "prefix_sweep_cpu.png").exists()


def test_kv_budget_small_pools_preempt_and_lose_nothing(tmp_path):
    kv_budget.main(["--streams", "4", "--requests", "8", "--fractions", "0.5", "0.3", "--no-dense",
                    "--results-dir", str(tmp_path)])
    out = json.loads((tmp_path / "kv_budget_cpu.json").read_text())
    roomy, *tight = out["rows"]
    assert roomy["preemptions"] == 0 and sum(r["preemptions"] for r in tight) > 0
    for r in out["rows"]:
        assert r["completed"] == r["requests_matching_roomy"] == 8 and r["blocks_held_after"] == 0
    assert all(r["kv_bytes_pool"] < roomy["kv_bytes_peak"] for r in tight)
    assert (tmp_path / "kv_budget_cpu.png").exists()


def test_buffer_cache_runs_every_limit_and_keeps_within_it(tmp_path):
    import mlx.core as mx

    own = mx.set_cache_limit(1 << 20)
    mx.set_cache_limit(own)
    buffer_cache.main(["--streams", "4", "--requests", "8", "--limits-gb", "mlx", "default", "0",
                       "--rounds", "2", "--results-dir", str(tmp_path)])
    out = json.loads((tmp_path / "buffer_cache_cpu.json").read_text())
    assert [r["limit"] for r in out["rows"]] == ["mlx", "default", "0"]
    assert len(out["runs"]) == 6 and len({r["output_tokens"] for r in out["runs"]}) == 1
    zero = out["rows"][2]
    assert zero["cache_limit_bytes"] == zero["cache_bytes_max"] == 0
    assert out["rows"][0]["cache_limit_bytes"] == out["meta"]["mlx_cache_limit_bytes"] == own
    assert mx.set_cache_limit(own) == own     # MLX's own limit is back


def test_step_profile_times_token_processing_with_outputs_as_served(tmp_path):
    for outputs in ("every", "due"):
        out = tmp_path / f"{outputs}.json"
        step_profile.main(["--batch", "4", "--steps", "3", "--prompt-len", "8", "--served-outputs", outputs,
                           "--out", str(out)])
        saved = json.loads(out.read_text())
        assert saved["served_outputs"] == outputs
        [row] = saved["rows"]
        assert row["batch"] == 4 and 0 < row["process_ms"] < row["step_ms"]


def test_kv_sharing_computes_a_shared_prefix_once(tmp_path):
    kv_sharing.main(["--streams", "4", "--prefix-len", "64", "--suffix-len", "8", "--gen-len", "4", "--n", "4",
                     "--no-dense", "--results-dir", str(tmp_path)])
    rows = {(r["case"], r["system"]): r for r in json.loads((tmp_path / "kv_sharing_cpu.json").read_text())["rows"]}
    shared, alone = rows["shared prefix", "ours"], rows["shared prefix", "ours-no-apc"]
    assert shared["prompt_tokens"] == alone["prompt_tokens_computed"] == 4 * 72
    assert shared["prompt_tokens_computed"] == 64 + 4 * 8       # the prefix once, then each suffix
    # n = 4 completions of one 64-token prompt: the first computes it, the others its last block
    # (a token of its own must be computed to sample from).
    assert rows["parallel sampling", "ours"]["prompt_tokens_computed"] == 64 + 3 * 16
    for case in ("shared prefix", "parallel sampling"):
        assert rows[case, "ours"]["kv_bytes_peak"] < rows[case, "ours-no-apc"]["kv_bytes_peak"]


def test_prefill_stall_chunks_keep_running_streams_decoding(tmp_path):
    prefill_stall.main(["--streams", "2", "--stream-prompt", "16", "--long-prompt", "600", "--budgets", "128",
                        "--no-mlx-lm", "--results-dir", str(tmp_path)])
    chunked, whole = json.loads((tmp_path / "prefill_stall_cpu.json").read_text())["rows"]
    # 600 tokens at most 126 a step beside two decodes: five steps or more, and a token
    # for each running stream in all but the step that queued before the prompt came.
    assert chunked["steps_until_first_token"] >= 5
    assert chunked["tokens_during_min"] >= chunked["steps_until_first_token"] - 2
    assert whole["budget"] == 602 and whole["steps_until_first_token"] <= 3
    assert chunked["tokens_during_min"] > whole["tokens_during_min"] + 2


def test_structured_output_runs_every_request_to_its_length(tmp_path):
    """Constrained or not, EOS banned: every request makes all its tokens, so the
    systems' throughputs compare like for like."""
    structured_output.main(["--concurrency", "2", "--requests-per-stream", "2", "--prompt-len", "8",
                            "--gen-len", "6", "--rounds", "1", "--results-dir", str(tmp_path)])
    data = json.loads((tmp_path / "structured_output_cpu.json").read_text())
    assert [r["system"] for r in data["rows"]] == list(structured_output.SYSTEMS)
    assert all(r["output_tokens"] == 4 * 6 for r in data["rows"])
    assert data["rows"][0]["tok_s_vs_free"] == 1.0 and data["mask"][0]["mask_ms_per_step"] > 0


def test_hit_profile_hits_only_in_its_hit_pass(tmp_path):
    hit_profile.main(["--prefix-len", "64", "--suffix-len", "8", "--jitter", "0.5", "--streams", "2",
                      "--requests", "6", "--output-len", "4", "--kv-cache-gb", "0.05", "--tag", "t",
                      "--pad-rows", "off", "on", "--early-read", "off", "on", "--results-dir", str(tmp_path)])
    out = json.loads((tmp_path / "hit_profile_t.json").read_text())
    modes = [(pad, early) for pad in ("off", "on") for early in ("off", "on")]
    assert out["pad_rows_auto"] is False
    assert set(out["ttft_ratio_miss_over_hit"]) == {f"{pad}, early read {early}" for pad, early in modes}
    assert [(r["pad_rows"], r["early_read"], r["pass"]) for r in out["rows"]] == [
        (*m, kind) for m in modes for kind in ("miss", "hit")]
    for r in out["rows"]:
        assert r["cached_tokens_p50"] == (64 if r["pass"] == "hit" else 0)   # four whole blocks
        assert r["ttft_steps_p50"] >= 2 and r["mixed"]["n"] >= 1 and r["decode"]["n"] >= 1


def test_run_meta_records_the_mlx_settings_of_the_environment(monkeypatch):
    from argparse import Namespace

    from bench.bench_continuous_vs_static import run_meta
    for k in [k for k in os.environ if k.startswith("MLX_")]:
        monkeypatch.delenv(k)
    args = Namespace(model="m", results_dir="/somewhere")
    assert "mlx_env" not in run_meta(args) and "results_dir" not in run_meta(args)["args"]
    monkeypatch.setenv("MLX_PROBE_SETTING", "7")
    assert run_meta(args)["mlx_env"] == {"MLX_PROBE_SETTING": "7"}


def test_loop_profile_times_hits_through_each_driver(tmp_path):
    loop_profile.main(["--prefix-len", "64", "--suffix-len", "8", "--jitter", "0.5", "--ban-eos", "--streams", "2",
                       "--requests", "4", "--output-len", "4", "--kv-cache-gb", "0.05", "--tag", "t",
                       "--results-dir", str(tmp_path)])
    rows = {r["driver"]: r for r in json.loads((tmp_path / "loop_profile_t.json").read_text())["rows"]}
    assert set(rows) == {"step", "thread", "process"}
    assert all(r["requests"] >= 1 and r["ttft_p50_ms"] > 0 for r in rows.values())
    for d in ("thread", "process"):   # the parts a server sees, from both sides of the loop
        assert rows[d]["requests"] >= 4
        assert {"to_engine", "engine_queue", "engine_prefill"} <= set(rows[d]["parts_p50_ms"])
    assert "parts_p50_ms" not in rows["step"]
    mixed = rows["thread"]["mixed"]   # the loop's own steps, timed where it makes them
    assert mixed["n"] >= 4 and mixed["wall"] > 0 and mixed["between"] >= 0 and mixed["prefills"] >= 1
    assert rows["thread"]["decode"]["prefills"] == 0


def test_loop_profile_can_keep_its_streams_in_step(tmp_path):
    loop_profile.main(["--prefix-len", "64", "--suffix-len", "8", "--streams", "2", "--requests", "4",
                       "--output-len", "4", "--kv-cache-gb", "0.05", "--driver", "thread", "--in-step",
                       "--tag", "t", "--results-dir", str(tmp_path)])
    out = json.loads((tmp_path / "loop_profile_t.json").read_text())
    assert out["args"]["in_step"] is True and [r["driver"] for r in out["rows"]] == ["thread"]
    assert out["rows"][0]["requests"] >= 4 and out["rows"][0]["mixed"]["prefills"] >= 1


def test_step_ops_counts_each_kind_of_step(tmp_path):
    step_ops.main(["--prefix-len", "64", "--suffix-len", "8", "--streams", "2", "--repeats", "2",
                   "--kv-cache-gb", "0.05", "--tag", "t", "--results-dir", str(tmp_path)])
    rows = {r["step"]: r for r in json.loads((tmp_path / "step_ops_t.json").read_text())["rows"]}
    hit = rows.pop("hit: suffix prefill beside the decodes")
    assert set(rows) == {"decode (compiled)", "decode (eager)"} and hit["tokens"] == 8 + 2
    for r in (hit, *rows.values()):
        assert r["primitives"] == sum(r["by_type"].values()) > r["views"] > 0 and len(r["queue_ms"]) == 2
    assert hit["primitives"] > rows["decode (eager)"]["primitives"] and hit["by_type"]["Matmul"] >= 4


def test_shape_plans_counts_the_row_grid(tmp_path):
    shape_plans.main(["--hidden", "32", "--out-dims", "48", "--rows", "17", "64", "--count", "3", "--heads", "4",
                      "--kv-heads", "2", "--head-dim", "8", "--tag", "t", "--results-dir", str(tmp_path)])
    out = json.loads((tmp_path / "shape_plans_t.json").read_text())
    assert out["grid_sizes"] == 16 and out["grid_waste_max"] < 1 / 8   # 8 sizes an octave over two octaves
    assert [r["op"] for r in out["rows"]] == ["matmul 32->48", "unfused attention"]
    assert all(r["new_shape_ms_p50"] > 0 and r["seen_shape_ms_p50"] > 0 for r in out["rows"])


def test_sliding_window_times_both_windowed_ways_and_they_agree(tmp_path):
    out = tmp_path / "sw.json"
    sliding_window.main(["--window", "24", "--batch", "2", "--context", "40", "200", "--chain", "1", "--repeats", "1",
                         "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    ways = {"full layer", "window, whole context read", "window, its blocks read"}
    if any(available(d) for d in KERNELS):   # a GPU's decode kernel runs beside them
        ways |= {"full layer, decode kernel", "window, decode kernel"}
    assert {r["way"] for r in rows} == ways
    assert len(rows) == 2 * len(ways) and all(r["us_per_call"] > 0 and r["max_abs_diff_windowed_ways"] < 1e-4 for r in rows)


def test_moe_determinism_runs_each_way_of_mlx_lms_forward(tmp_path):
    out = tmp_path / "moe.json"
    moe_determinism.main(["--lengths", "9", "40", "--runs", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["way"]) for r in rows] == [
        (n, w) for n in (9, 40) for w in ("one graph", "eval after each layer", "experts unsorted")]
    assert all(len(r["max_abs_logit_off_cpu"]) == 2 for r in rows)
    if not any(available(d) for d in KERNELS):   # the CPU against itself
        assert all(d < 1e-5 for r in rows for d in r["max_abs_logit_off_cpu"])
