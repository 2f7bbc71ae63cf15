"""The comparison harness: a partial bundle still gets a headline, rows keep the meta of
the run that measured them, warm-ups stay within what a run reaches, mlx_lm.server gets a
fresh server after its sweep, and a run stopped with SIGTERM stops the servers it started."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import compare

from .serving import exited, live_pids

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def own_sigterm():
    """`compare.main` in this process takes SIGTERM over (to stop its servers); give it back."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _row(system, workload, concurrency, tok_s, ttft, rate=None, failed=0):
    return {"system": system, "workload": workload, "concurrency": concurrency, "request_rate": rate,
            "output_tok_s": tok_s, "ttft_p50_s": ttft, "ttft_mean_s": ttft, "failed": failed}


def test_headline_of_a_partial_bundle_leaves_out_what_it_cannot_compare():
    rows = [_row("mlx_lm.server", "random", 1, 100.0, 0.5), _row("mlx_lm.server", "random", 8, 200.0, 1.0),
            _row("ours", "random", 256, 900.0, 0.3),                       # no 8-stream row: merged apart
            _row("ours-bare-engine", "random", 256, 1000.0, 0.2), _row("ours-bare-engine", "random", 8, 0.0, None, failed=8),
            _row("ours", "random-poisson", None, 50.0, 0.04, rate=1.2),
            _row("mlx_lm.server", "random-poisson", None, 0.0, None, rate=1.2, failed=96),
            _row("ours", "prefix", 8, 400.0, 0.1), _row("ours-no-apc", "prefix", 8, 200.0, 0.5)]
    h = compare.headline(rows, None)
    assert h["load_80pct_concurrency"] == 8 and h["saturation_throughput_ratio"] == 4.5
    assert "ttft_p50_ratio_at_80pct_concurrency" not in h       # ours has no row at 8 streams
    assert "ttft_p50_ratio_at_80pct_rate" not in h              # mlx_lm.server's Poisson row failed
    assert abs(h["serve_overhead_throughput"] - 0.1) < 1e-9     # 256 streams, the only point both ran
    assert abs(h["apc_ttft_p50_speedup"] - 5.0) < 1e-9


def test_a_sweep_point_where_every_request_failed_is_noted_not_drawn_as_zero():
    rows = [dict(_row("mlx_lm.server", "random", c, tok_s, None), completed=n)
            for c, tok_s, n in ((64, 1000.0, 128), (256, 0.0, 0), (128, 650.0, 256))]
    rows.append(_row("ours", "random", 256, 15000.0, 0.2))
    assert compare.sweep_points(rows, "mlx_lm.server") == ([(64, 1000.0), (128, 650.0)], [256])
    assert compare.sweep_points(rows, "ours") == ([(256, 15000.0)], [])


def test_a_variants_prefix_rows_are_compared_with_each_other():
    """HAProxy's APC on / off pairs its own two variant rows, never the proxy's; a
    variant's row counts as its workload when a --merge run replaces rows."""
    rows = [_row("ours", "prefix", 8, 400.0, 0.05), _row("ours-no-apc", "prefix", 8, 200.0, 0.1),
            _row("ours", "prefix (HAProxy)", 8, 400.0, 0.02), _row("ours", "prefix (HAProxy, APC off)", 8, 200.0, 0.09)]
    h = compare.headline(rows, None)
    assert abs(h["apc_ttft_p50_speedup"] - 2.0) < 1e-9
    assert abs(h["apc_ttft_p50_speedup_haproxy"] - 4.5) < 1e-9
    assert [compare._plan_of(w) for w in ("prefix (HAProxy, APC off)", "random (HAProxy)", "random-poisson")] == \
        ["prefix", "random", "poisson"]
    assert compare.VARIANTS["ours-haproxy-no-apc"].engine == {"enable_prefix_caching": False}


def test_numbered_app_variants_make_valid_app_arguments(tmp_path):
    """`ours-tokenize-threads-N`, `ours-chunks-N` and `ours-no-token-cache` give the app
    their setting, as arguments the app accepts; a name whose number does not parse is
    refused before anything starts."""
    from deployments.app import AppArgs

    for name, setting in (("ours-tokenize-threads-8", {"tokenize_threads": 8}),
                          ("ours-chunks-0", {"max_stream_chunks_per_s": 0.0}),
                          ("ours-no-token-cache", {"prompt_token_cache_tokens": 0})):
        v = compare.app_variant(name)
        assert v.setting == v.serve == setting
        args = AppArgs.model_validate(compare.our_app_config("m", {}, **v.serve)["args"])
        assert {k: getattr(args, k) for k in setting} == setting
    for bad in ("ours-tokenize-threads-0", "ours-tokenize-threads-x", "ours-chunks-q"):
        assert compare.app_variant(bad) is None
        try:
            compare.main(["--systems", bad, "--results-dir", str(tmp_path)])
            raise AssertionError(f"{bad} was accepted")
        except SystemExit as e:
            assert e.code == 2


def test_each_prefix_length_is_a_workload_of_its_own_text_and_ratio():
    """`--prefix-len 2048 7680`: the first length keeps the `prefix` rows, the second is
    `prefix-7680`; the longer prefixes never start with the shorter ones' text (else APC
    would hit blocks another workload cached), and the headline has a ratio per length."""
    import argparse

    from mlx_lm.utils import load_tokenizer

    from runtime.models import default_model_path

    tok = load_tokenizer(default_model_path())
    args = argparse.Namespace(prefix_len=[48, 96], prefix_prompts=4, num_prefixes=2, suffix_len=8,
                              prefix_output_len=4)
    (short_name, short_len, short), (long_name, long_len, long) = compare.Workloads(tok, args).prefixes()
    assert (short_name, short_len, long_name, long_len) == ("prefix", 48, "prefix-96", 96)
    firsts = lambda reqs: {tuple(tok.encode(r.prompt)[:32]) for r in reqs}  # noqa: E731
    assert len(firsts(short)) == 2 and len(firsts(long)) == 2 and not firsts(short) & firsts(long)
    assert compare._plan_of("prefix-96") == compare._plan_of("prefix-96 (HAProxy)") == "prefix"
    rows = [dict(_row("ours", "prefix", 8, 400.0, 0.05), prefix_len=48),
            dict(_row("ours-no-apc", "prefix", 8, 200.0, 0.1), prefix_len=48),
            dict(_row("ours", "prefix-96", 8, 400.0, 0.05), prefix_len=96),
            dict(_row("ours-no-apc", "prefix-96", 8, 200.0, 0.3), prefix_len=96)]
    rows += [dict(_row("ours", f"{w} (HAProxy{off})", 8, 400.0, t), prefix_len=n)
             for w, n, off, t in (("prefix", 48, "", 0.04), ("prefix", 48, ", APC off", 0.12),
                                  ("prefix-96", 96, "", 0.04), ("prefix-96", 96, ", APC off", 0.32))]
    h = compare.headline(rows, None)
    assert abs(h["apc_ttft_p50_speedup"] - 2.0) < 1e-9
    assert {k: round(v, 9) for k, v in h["apc_ttft_p50_speedup_by_prefix_len"].items()} == {48: 2.0, 96: 6.0}
    assert {k: round(v, 9) for k, v in h["apc_ttft_p50_speedup_by_prefix_len_haproxy"].items()} == \
        {48: 3.0, 96: 8.0}


def test_replot_rewrites_the_headline_and_keeps_the_runs_meta(tmp_path, own_sigterm):
    """`--replot` redoes a bundle's headline from its rows (a harness that learned a new
    ratio reads old runs too) and keeps the meta the run wrote beside it."""
    rows = [dict(_row("ours", w, 8, 400.0, t), prefix_len=n, meta={"model": "m", "device": "d"})
            for w, n, t in (("prefix", 48, 0.05), ("prefix-96", 96, 0.05))]
    rows += [dict(_row("ours-no-apc", w, 8, 200.0, t), prefix_len=n, meta={"model": "m", "device": "d"})
             for w, n, t in (("prefix", 48, 0.1), ("prefix-96", 96, 0.3))]
    (tmp_path / "compare_t.json").write_text(json.dumps(rows))
    (tmp_path / "compare_t_headline.json").write_text(json.dumps({"headline": {}, "meta": {"run": "first"}}))
    compare.main(["--replot", "--tag", "t", "--results-dir", str(tmp_path)])
    out = json.loads((tmp_path / "compare_t_headline.json").read_text())
    assert out["meta"] == {"run": "first"}
    assert {k: round(v, 9) for k, v in out["headline"]["apc_ttft_p50_speedup_by_prefix_len"].items()} == \
        {"48": 2.0, "96": 6.0}
    assert (tmp_path / "compare_t.png").exists()


def test_warm_up_runs_only_the_sweep_points_its_workloads_reach():
    """A Poisson-only run must not warm a 256-stream burst its arrivals never reach
    (mlx_lm.server stops generating after one); prefix and multi-turn need no sweep."""
    from types import SimpleNamespace

    args = SimpleNamespace(concurrency=[1, 8, 32, 64, 128, 256], poisson_prompts=96)
    assert compare.warm_sweep({"random", "prefix"}, args) == [1, 8, 32, 64, 128, 256]
    assert compare.warm_sweep({"poisson"}, args) == [1, 8, 32, 64]
    assert compare.warm_sweep({"prefix", "multi-turn"}, args) == []


def test_prefix_warm_up_covers_every_batch_bucket_of_its_hit_waves():
    """Waves of 8 hits can prefill 1, 2, 4 or 8 at a time; the warm-up runs the
    measured concurrency first (its cold wave caches the prefixes), then the lower
    powers of two."""
    assert compare.warm_prefix_concurrency(8) == [8, 1, 2, 4]
    assert compare.warm_prefix_concurrency(6) == [6, 1, 2, 4]
    assert compare.warm_prefix_concurrency(1) == [1]


def test_rows_keep_the_meta_of_the_run_that_measured_them(tmp_path):
    """Rows written before a run is cut short carry its meta, so a later --merge run
    does not stamp its own arguments on them."""

    out = tmp_path / "compare_t.json"
    first = {"args": {"systems": ["ours"]}}
    compare.save(out, [_row("ours", "prefix", 8, 400.0, 0.1)], first)      # then the run is killed
    rows = json.loads(out.read_text()) + [_row("mlx_lm.server", "random-poisson", None, 50.0, 0.4, rate=1.0)]
    compare.save(out, rows, {"args": {"systems": ["mlx_lm.server"]}})
    saved = {r["system"]: r["meta"]["args"]["systems"] for r in json.loads(out.read_text())}
    assert saved == {"ours": ["ours"], "mlx_lm.server": ["mlx_lm.server"]}


def test_a_run_cut_short_keeps_its_points_and_stops_its_servers(tmp_path):
    """SIGTERM (a time limit) mid-run: every sweep point measured so far is in the JSON,
    and the server the run started is gone."""
    out = tmp_path / "compare_t.json"
    run = subprocess.Popen(
        [sys.executable, "bench/compare.py", "--tag", "t", "--results-dir", str(tmp_path), "--systems",
         "mlx_lm.server", "--concurrency", "1", "32", "--min-prompts", "2", "--prompts-per-stream", "16",
         "--input-len", "8", "--output-len", "32", "--workloads", "random", "--no-kv-memory"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    server = None
    try:
        deadline = time.monotonic() + 240
        while not out.exists() and time.monotonic() < deadline and run.poll() is None:
            server = server or next(iter(live_pids("-P", str(run.pid), "-f", "mlx_lm.server")), None)
            time.sleep(0.2)
        assert server is not None, "compare.py started no mlx_lm.server"
        assert out.exists() and run.poll() is None, "the first point was not written while the run went on"
        run.send_signal(signal.SIGTERM)
        assert run.wait(60) != 0
        assert exited(server, 30), "the server outlived the run that started it"
        rows = json.loads(out.read_text())
        assert [(r["system"], r["concurrency"], r["completed"]) for r in rows] == [("mlx_lm.server", 1, 16)]
        assert rows[0]["meta"]["args"]["concurrency"] == [1, 32]
    finally:
        if run.poll() is None:
            run.kill()
        if server is not None:
            try:
                os.kill(server, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_stream_that_stops_fails_as_stalled_instead_of_hanging():
    """A server that sends its first token and then nothing, without closing the stream
    (as a generation thread that died leaves it), costs the run `stall_s`, not forever."""
    import asyncio

    from bench import serve_bench as sb

    chunk = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        await writer.drain()
        await asyncio.sleep(30)
        writer.close()

    async def go():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        backend = sb.HTTPBackend(f"http://127.0.0.1:{port}", "m", stall_s=1.0)
        try:
            return await asyncio.wait_for(backend.send(sb.Request("hi", None, 4), None), 20)
        finally:
            await backend.aclose()
            server.close()

    res = asyncio.run(go())
    assert not res.ok and res.error == "stalled: no bytes for 1 s after the first token"


def test_rounds_ratios_are_taken_within_a_round():
    """A host that slows down for one whole round moves every system in it; the ratio
    within each round stays, and a failed measurement leaves its round out."""
    from bench import rounds

    def row(r, system, ttft, tok_s=100.0, failed=0):
        return {"round": r, "point": "4 streams", "system": system, "ttft_p50_s": ttft,
                "tpot_p50_s": 0.01, "output_tok_s": tok_s, "failed": failed}
    rows = [row(0, "mlx_lm.server", 0.4), row(0, "ours", 0.2, 90.0), row(0, "ours-bare-engine", 0.1),
            row(1, "mlx_lm.server", 1.2), row(1, "ours", 0.6, 45.0), row(1, "ours-bare-engine", 0.3, 50.0),
            row(2, "mlx_lm.server", 0.4), row(2, "ours", 0.4, failed=3), row(2, "ours-bare-engine", 0.1)]
    s = rounds.summarize(rows, ["mlx_lm.server", "ours", "ours-bare-engine"])["4 streams"]
    assert s["ttft_p50_ratio_ours_over_mlx_lm"] == 0.5
    assert abs(s["serve_throughput_cost"] - 0.1) < 1e-9
    assert abs(s["serve_ttft_p50_added_s"] - 0.2) < 1e-9     # median of 0.1 and 0.3
    assert s["ours"]["ttft_p50_s"] == 0.4                     # rounds 0 and 1 only


def test_rounds_compare_the_grpc_transport_within_rounds_and_split_ttft():
    from bench import rounds

    def row(r, system, ttft, outside):
        return {"round": r, "point": "1 streams", "system": system, "ttft_p50_s": ttft, "tpot_p50_s": 0.01,
                "output_tok_s": 100.0, "failed": 0,
                "ttft_split_p50_s": {"request": 0.003, "first_token": ttft - 0.003 - outside, "outside": outside}}
    rows = [row(0, "ours", 0.10, 0.012), row(0, "ours-grpc", 0.09, 0.008),
            row(1, "ours", 0.30, 0.010), row(1, "ours-grpc", 0.28, 0.006),
            row(2, "ours", 0.12, 0.011), row(2, "ours-grpc", 0.13, 0.009)]
    s = rounds.summarize(rows, ["ours", "ours-grpc"])["1 streams"]
    assert abs(s["grpc_ttft_p50_change_s"] - -0.01) < 1e-9     # median of -0.01, -0.02, +0.01
    assert s["grpc_throughput_ratio"] == 1.0
    assert s["ours_ttft_split_p50_s"]["outside"] == 0.011
    assert s["ours-grpc_ttft_split_p50_s"]["outside"] == 0.008


def test_rounds_cost_an_app_variant_against_the_bare_engine():
    from bench import rounds

    def row(r, system, ttft, tok_s):
        return {"round": r, "point": "16 streams", "system": system, "ttft_p50_s": ttft, "tpot_p50_s": 0.01,
                "output_tok_s": tok_s, "failed": 0}
    rows = [row(0, "ours-haproxy", 0.15, 96.0), row(0, "ours-bare-engine", 0.10, 100.0),
            row(1, "ours-haproxy", 0.32, 40.0), row(1, "ours-bare-engine", 0.30, 50.0),
            row(2, "ours-haproxy", 0.12, 99.0), row(2, "ours-bare-engine", 0.11, 100.0)]
    s = rounds.summarize(rows, ["ours-haproxy", "ours-bare-engine"])["16 streams"]
    assert abs(s["haproxy_serve_throughput_cost"] - 0.04) < 1e-9    # median of 4, 20 and 1 %
    assert abs(s["haproxy_serve_ttft_p50_added_s"] - 0.02) < 1e-9   # median of 50, 20 and 10 ms
    assert "serve_throughput_cost" not in s and "haproxy_throughput_ratio" not in s   # no "ours" to compare


def test_arrivals_average_the_rate_and_spread_with_burstiness():
    """Gaps average 1/rate at every burstiness, with a coefficient of variation of
    1/sqrt(burstiness) (`vllm bench serve`'s gamma arrivals); burstiness 1 draws what the
    Poisson runs before it drew, a burst has no gaps, and a shape of 0 is refused, by the
    function and by the command line."""
    import math

    import numpy as np
    import pytest

    from bench import serve_bench as sb

    n, rate = 20000, 4.0
    assert np.array_equal(sb.arrival_gaps(n, rate, 1.0, seed=3), np.random.default_rng(3).exponential(1 / rate, n))
    for shape in (0.25, 1.0, 4.0):
        g = sb.arrival_gaps(n, rate, shape, seed=3)
        assert abs(g.mean() * rate - 1) < 0.05
        assert abs(g.std() / g.mean() * math.sqrt(shape) - 1) < 0.08
    assert not sb.arrival_gaps(5, math.inf, 0.5).any()
    with pytest.raises(ValueError, match="burstiness"):
        sb.arrival_gaps(5, rate, 0.0)
    cli = subprocess.run([sys.executable, "bench/serve_bench.py", "--burstiness", "0"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert cli.returncode == 2 and "--burstiness must be > 0" in cli.stderr


def test_compare_and_rounds_pass_burstiness_to_their_poisson_arrivals(tmp_path, own_sigterm):
    """`--burstiness` reaches the Poisson row's arrivals (recorded in the row, and the
    gaps drawn with that shape); a shape <= 0 is refused before anything starts."""
    from bench import rounds
    from bench import serve_bench as sb

    for main in (compare.main, rounds.main):
        try:
            main(["--burstiness", "0", "--results-dir", str(tmp_path)])
            raise AssertionError("--burstiness 0 was accepted")
        except SystemExit as e:
            assert e.code == 2
    compare.main(["--tag", "b", "--results-dir", str(tmp_path), "--systems", "ours-bare-engine",
                  "--workloads", "poisson", "--poisson-rate", "40", "--burstiness", "0.25",
                  "--poisson-prompts", "6", "--input-len", "8", "--output-len", "2", "--concurrency", "1",
                  "--no-kv-memory"])
    (row,) = json.loads((tmp_path / "compare_b.json").read_text())
    assert (row["workload"], row["burstiness"], row["completed"]) == ("random-poisson", 0.25, 6)
    assert row["request_rate"] == 40
    assert row["duration_s"] >= sb.arrival_gaps(5, 40, 0.25, seed=1).sum()
    mean = row["ttft_split_mean_s"]                  # the engine's parts of each TTFT, as means: within its mean
    assert mean.keys() == row["ttft_split_p50_s"].keys() and "engine_prefill" in mean
    assert 0 < sum(mean.values()) <= row["ttft_mean_s"]
    rounds.main(["--tag", "b", "--results-dir", str(tmp_path), "--systems", "ours-bare-engine", "--rounds", "1",
                 "--concurrency", "1", "--rate", "40", "--burstiness", "0.25", "--poisson-prompts", "4",
                 "--min-prompts", "2", "--input-len", "8", "--output-len", "2"])
    got = {r["point"]: r["burstiness"] for r in json.loads((tmp_path / "rounds_b.json").read_text())["rows"]}
    assert got == {"1 streams": 1.0, "Poisson": 0.25}


def test_workloads_can_share_lengths_and_differ_in_text():
    """rounds.py gives every system of a round its own text at the same lengths."""
    import random

    from mlx_lm.utils import load_tokenizer

    from bench import serve_bench as sb
    from runtime.models import default_model_path

    tok = load_tokenizer(default_model_path())
    a, b = (sb.random_workload(sb.TextSource(tok, seed), 8, 64, 16, 0.5, lengths=random.Random(7))
            for seed in (1, 2))
    assert [r.output_len for r in a] == [r.output_len for r in b]
    assert [len(tok.encode(r.prompt)) for r in a] == [len(tok.encode(r.prompt)) for r in b]
    assert all(x.prompt != y.prompt for x, y in zip(a, b))
    c = sb.random_workload(sb.TextSource(tok, 2), 8, 64, 16, 0.5)
    assert [r.output_len for r in c] != [r.output_len for r in a]


def test_mlx_lm_server_runs_the_workloads_after_its_sweep_on_a_fresh_server(tmp_path):
    """After a burst of hundreds of streams, or waves of long prompts, mlx_lm.server can
    stop generating; the workloads after its sweep (the first prefix length with
    multi-turn), each further prefix length and its Poisson arrivals each run on a
    server of their own, not on one that may have stopped."""
    cmd = [sys.executable, "bench/compare.py", "--tag", "t", "--results-dir", str(tmp_path), "--systems",
           "mlx_lm.server", "--concurrency", "1", "--min-prompts", "2", "--input-len", "8", "--output-len", "4",
           "--workloads", "random", "multi-turn", "poisson", "prefix", "--poisson-prompts", "2", "--num-sessions", "2",
           "--turns", "2", "--turn-len", "8", "--turn-output-len", "4", "--prefix-len", "16", "32",
           "--prefix-prompts", "2", "--prefix-concurrency", "1", "--suffix-len", "4", "--prefix-output-len", "2",
           "--no-kv-memory"]
    run = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    servers: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while run.poll() is None and time.monotonic() < deadline:
            servers |= set(live_pids("-P", str(run.pid), "-f", "mlx_lm.server"))
            time.sleep(0.1)
        assert run.wait(10) == 0
    finally:
        if run.poll() is None:
            run.kill()
    rows = json.loads((tmp_path / "compare_t.json").read_text())
    assert sorted((r["workload"], r["failed"]) for r in rows) == [
        ("multi-turn", 0), ("prefix", 0), ("prefix-32", 0), ("random", 0), ("random-poisson", 0)]
    assert len(servers) == 4, servers
