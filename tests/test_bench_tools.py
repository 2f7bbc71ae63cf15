"""The smaller benchmarks: `process_cpu` names processes without this machine's paths
and reads the window where the engine was busiest; `mixed_prefill` runs end to end and
restores the shipped grouping after its other arm."""

import json
import sys

from bench import mixed_prefill, process_cpu
from runtime.attention import metadata


def test_process_names_carry_no_paths():
    name = process_cpu.process_name
    assert name(["/opt/py/bin/python3.11", "-m", "runtime.engine_process", "5"]) == "python -m runtime.engine_process"
    assert name(["/opt/py/bin/python3.11", "-u", "/opt/site/ray/log_monitor.py", "--x"]) == "python log_monitor.py"
    assert name(["/opt/py/bin/python3.11 -u /opt/site/ray/dashboard.py --flag"]) == "python dashboard.py"
    assert name(["python3", "-c", "import sys; sys.path = ['/opt/site']"]) == "python -c"
    assert name(["ray::ServeReplica:llm:OpenAIServer.handle_request"]) == "ray::ServeReplica:llm:OpenAIServer"
    assert name(["/opt/site/ray/core/src/ray/raylet/raylet", "--port=1"]) == "raylet"


def test_busiest_window_is_the_engines_and_sums_by_name():
    tick = process_cpu.TICKS
    engine = "python -m runtime.engine_process"
    samples = [(float(t), {1: (int(e * tick), engine), 2: (int(p * tick), "ray::ProxyActor"),
                           3: (int(p * tick), "ray::ProxyActor")})
               for t, e, p in ((0, 0, 0), (10, 2, 1), (20, 12, 1), (30, 13, 2))]
    rates = process_cpu.busiest_window(samples, engine)
    assert abs(rates[engine] - 100.0) < 1e-6 and rates["ray::ProxyActor"] == 0.0
    assert process_cpu.busiest_window(samples[:1], engine) == {}


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
