"""Timers around an engine's step parts, for the benchmarks that profile its steps.

`StepClock` times scheduling, building, queuing, waiting for the device and processing
tokens, step by step; `top_functions` reads a cProfile of steps as milliseconds a step.
"""

import cProfile
import pstats
import time
from collections import defaultdict

from runtime import LLMEngine

PARTS = ("schedule", "build", "queue", "wait", "process")


class StepClock:
    """Wraps the engine's step parts in timers (instance attributes over the methods)
    and files each step's times under the kind of batch it built."""

    def __init__(self, engine: LLMEngine, time_loop: bool = False):
        """`time_loop`: the steps the engine's own loop makes (`EngineLoop` calls
        `engine.step`) are timed too, with the loop's time between them ("between")."""
        self.engine = engine
        self._step = engine.step
        self._ended: float | None = None
        self.cur = dict.fromkeys(PARTS, 0.0)
        self.kind = "idle"
        self.prefills = 0   # sequences with prompt tokens in the step
        self.steps: dict[str, list[dict]] = defaultdict(list)
        sched, runner = engine.scheduler, engine.runner
        self._orig = [(sched, "schedule"), (runner, "build"), (runner, "queue"), (runner, "wait"),
                      (runner, "collect"), (engine, "_process")]
        sched.schedule = self._timed(sched.schedule, "schedule", self._classify)
        runner.build = self._timed(runner.build, "build")
        runner.queue = self._timed(runner.queue, "queue")
        runner.wait = self._timed(runner.wait, "wait")
        runner.collect = self._timed(runner.collect, "wait")
        engine._process = self._timed(engine._process, "process")
        if time_loop:
            engine.step = self.step
            self._orig.append((engine, "step"))

    def _classify(self, out):
        self.prefills = 0 if not out else sum(s.num_tokens > 1 for s in out.scheduled)
        self.kind = "idle" if not out else ("mixed" if self.prefills else "decode")

    def _timed(self, fn, part, after=None):
        def run(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            self.cur[part] += time.perf_counter() - t
            if after is not None:
                after(out)
            return out
        return run

    def step(self):
        self.cur = dict.fromkeys(PARTS, 0.0)
        t = time.perf_counter()
        outs = self._step()
        row = {k: v * 1e3 for k, v in self.cur.items()}
        row["wall"] = (time.perf_counter() - t) * 1e3
        row["between"] = 0.0 if self._ended is None else (t - self._ended) * 1e3
        row["prefills"] = self.prefills
        self._ended = time.perf_counter()
        self.steps[self.kind].append(row)
        return outs

    def total(self, part: str) -> float:
        """Milliseconds spent in `part` over every step timed."""
        return sum(r[part] for rows in self.steps.values() for r in rows)

    def close(self):
        for obj, name in self._orig:
            del obj.__dict__[name]


def top_functions(prof: cProfile.Profile, steps: int, n: int) -> list[tuple[str, float]]:
    """The `n` functions with the most own time, as ("file:line:function", ms a step)."""
    top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [(f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}", round(v[2] / steps * 1e3, 3)) for k, v in top]
