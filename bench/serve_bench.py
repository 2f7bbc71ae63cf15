"""Load generator for OpenAI-compatible servers (ours, `mlx_lm.server`, vllm-mlx, ...),
and for our bare engine in-process, with the same workloads and the same clock.

Arrivals are Poisson at `--request-rate` (requests/s; `inf` sends all at once, a
burst), or gamma-distributed with `--burstiness` other than 1 (below 1 burstier, above 1
more even, as in `vllm bench serve`), capped by `--max-concurrency` requests in flight.
Every request streams, and its chunks are timed as they arrive. Definitions follow
`vllm bench serve`:

- TTFT: request sent -> first chunk carrying output text.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one token.
- ITL: the gaps between successive chunks carrying output, pooled over requests.
- E2E: request sent -> last byte.
- Goodput: completed requests per second that met every SLO given by `--goodput`.
- Client CPU: this load generator's own CPU time over the run's wall time; near 1.0,
  the client (one event loop) and not the server may be what limits the figures.

Output token counts come from the server's `usage` (stream_options.include_usage).

Workloads:
- `random`: prompts of `--input-len` tokens (+- `--range-ratio`), `--output-len` new.
- `prefix`: `--num-prefixes` shared prefixes of `--prefix-len` tokens, each request one
  of them plus its own `--suffix-len` tokens.
- `multi-turn`: `--num-sessions` chat sessions of `--turns` turns; each turn sends the
  whole history (earlier questions and the server's answers) plus `--input-len` new
  tokens, so a prefix cache can reuse the history.

    python bench/serve_bench.py --base-url http://127.0.0.1:8000 --workload prefix \\
        --prefix-len 1024 --num-prefixes 4 --suffix-len 32 --output-len 32 \\
        --num-prompts 64 --max-concurrency 8
    python bench/serve_bench.py --backend engine --model default --workload random
"""

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CORPUS = Path(__file__).resolve().parents[1] / "runtime" / "models" / "corpus.txt"


# -- workloads ----------------------------------------------------------------------------
@dataclass
class Request:
    """One request to send. `messages` for chat, else `prompt`. Multi-turn requests
    carry their session and turn; the session's history is filled in when sent."""
    prompt: str | None
    messages: list[dict] | None
    output_len: int
    session: int | None = None
    turn: int = 0


class TextSource:
    """Prompts of a given token length: words of the bundled corpus in random order, cut
    to length in tokens by the model's tokenizer. Real words keep every server's
    tokenizer and chat template on their ordinary path; the random order keeps prompts
    from sharing a prefix (and a prefix cache's hits) unless a workload means them to."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tok = tokenizer
        self.words = CORPUS.read_text().split()
        self.rng = random.Random(seed)

    def text(self, n_tokens: int) -> str:
        n_tokens = max(1, n_tokens)
        words: list[str] = []
        ids: list[int] = []
        while len(ids) < n_tokens:
            words += self.rng.choices(self.words, k=n_tokens - len(ids))
            ids = self.tok.encode(" ".join(words), add_special_tokens=False)
        return self.tok.decode(ids[:n_tokens])


def random_workload(src: TextSource, n: int, input_len: int, output_len: int,
                    range_ratio: float, lengths: random.Random | None = None) -> list[Request]:
    """`lengths`: where the prompt and output lengths come from (default: `src`'s
    generator), so that workloads of different text can have the same lengths."""
    rng = lengths or src.rng
    lo, hi = 1 - range_ratio, 1 + range_ratio
    return [Request(src.text(round(input_len * rng.uniform(lo, hi))), None,
                    max(1, round(output_len * rng.uniform(lo, hi)))) for _ in range(n)]


def prefix_workload(src: TextSource, n: int, prefix_len: int, num_prefixes: int,
                    suffix_len: int, output_len: int) -> list[Request]:
    prefixes = [src.text(prefix_len) for _ in range(num_prefixes)]
    reqs = [Request(prefixes[i % num_prefixes] + " " + src.text(suffix_len), None, output_len)
            for i in range(n)]
    src.rng.shuffle(reqs)
    return reqs


def multi_turn_workload(src: TextSource, num_sessions: int, turns: int, input_len: int,
                        output_len: int) -> list[Request]:
    """Turn 0 of every session, then turn 1, ...; a turn waits for its session's
    previous answer (see `run`)."""
    return [Request(None, [{"role": "user", "content": src.text(input_len)}], output_len, s, t)
            for t in range(turns) for s in range(num_sessions)]


# -- results -------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    server_timing: dict[str, float] = field(default_factory=dict)   # seconds, from Server-Timing


def parse_server_timing(value: str) -> dict[str, float]:
    """A `Server-Timing` header (`name;dur=ms, ...`) as seconds per name."""
    out = {}
    for metric in value.split(","):
        name, *params = metric.strip().split(";")
        for param in params:
            key, _, v = param.strip().partition("=")
            if key == "dur" and name:
                try:
                    out[name] = float(v) / 1e3
                except ValueError:
                    pass   # a malformed duration: that metric is left out
    return out


def _stats(xs, scale: float = 1.0) -> dict:
    if not len(xs):
        return {"mean": None, "p50": None, "p95": None, "p99": None, "std": None}
    a = np.asarray(xs, dtype=float) * scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "std": float(a.std())}


def summarize(results: list[Result], duration: float, slo: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if r.ttft <= slo.get("ttft", math.inf) and r.e2e <= slo.get("e2el", math.inf)
            and (r.output_tokens <= 1 or (r.e2e - r.ttft) / (r.output_tokens - 1) <= slo.get("tpot", math.inf))]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": prompt, "total_output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (prompt + out_tokens) / duration,
        "goodput": len(good) / duration if slo else None,
        "ttft_s": _stats([r.ttft for r in ok]),
        "tpot_s": _stats(tpots),
        "itl_s": _stats([x for r in ok for x in r.itl]),
        "e2el_s": _stats([r.e2e for r in ok]),
        "ttfts": [r.ttft for r in ok],
        "server_timing_s": _split_ttft([r for r in ok if {"first_token", "engine_prefill"} & r.server_timing.keys()]),
    }


def _split_ttft(timed: list[Result]) -> dict | None:
    """A served stream's TTFT in parts: reading the request in the replica (`request`),
    the way to the first token (`first_token`), and `outside` the replica's handler (the
    hops through the proxy, both ways); within `request`, `read` (the body fetched from
    the proxy and parsed; the rest makes the prompt's tokens); within `first_token`, the
    parts the engine side timed (`RequestMetrics.ttft_parts`: the way to the engine loop
    and back, and the engine's own `engine_queue` and `engine_prefill`). Each part that
    every timed result has; None where the server (or engine) reports none."""
    if not timed:
        return None
    st = [r.server_timing for r in timed]
    keys = [k for k in st[0] if all(k in t for t in st)]
    out = {k: _stats([t[k] for t in st]) for k in keys}
    if {"request", "first_token"} <= set(keys):
        out["outside"] = _stats([r.ttft - t["request"] - t["first_token"] for r, t in zip(timed, st)])
    return out or None


# -- backends ------------------------------------------------------------------------------
def _carries_output(choice: dict) -> bool:
    """Whether a streamed choice carries generated tokens. Text can be empty for a token
    the tokenizer cannot spell (a random model samples the whole vocabulary), so a chunk
    counts when it has a text field at all; only a chat stream's role-only opening
    chunk does not."""
    if "text" in choice:
        return choice["text"] is not None
    delta = choice.get("delta") or {}
    content = delta.get("content")
    return bool(content) or (content is not None and "role" not in delta)


def _read_usage(res: Result, u: dict) -> None:
    res.prompt_tokens, res.output_tokens = u["prompt_tokens"], u["completion_tokens"]
    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


class HTTPBackend:
    """Streams from `/v1/completions` or `/v1/chat/completions`. `extra_body` rides along
    on every request (e.g. a logit bias that bans EOS, so every server produces exactly
    `output_len` tokens). With `stream=False` each request gets one whole response: its
    TTFT is then its end-to-end latency, which is what such a client waits for. A stream
    that sends nothing for `stall_s` fails as stalled, so a server that stops generating
    without closing its streams ends the run with errors instead of hanging it."""

    def __init__(self, base_url: str, model: str, extra_body: dict | None = None,
                 api_key: str | None = None, stream: bool = True, stall_s: float = 120.0):
        self.base = base_url.rstrip("/")
        self.model = model
        self.extra = extra_body or {}
        self.stream = stream
        self.stall_s = stall_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = None

    def _client(self):
        """One aiohttp session, made in the running loop. aiohttp, as `vllm bench serve`
        uses: with hundreds of streams, httpx's per-chunk cost made this client the
        bottleneck (one core at 100 %) before the servers were."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self.headers, timeout=aiohttp.ClientTimeout(total=600),
                connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20)
            self._stream_timeout = aiohttp.ClientTimeout(total=600, sock_read=self.stall_s)
        return self._session

    async def send(self, req: Request, messages: list[dict] | None) -> Result:
        body = {"model": self.model, "max_tokens": req.output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, **self.extra}
        if messages is not None:
            path, body["messages"] = "/v1/chat/completions", messages
        else:
            path, body["prompt"] = "/v1/completions", req.prompt
        res, last, pieces = Result(), None, []
        t0 = time.perf_counter()
        if not self.stream:
            return await self._send_whole(path, body, res, t0)
        session = self._client()
        try:
            async with session.post(self.base + path, json=body, timeout=self._stream_timeout) as r:
                if r.status != 200:
                    res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                    return res
                res.server_timing = parse_server_timing(r.headers.get("Server-Timing", ""))
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("usage"):
                        _read_usage(res, chunk["usage"])
                    for c in chunk.get("choices") or []:
                        if _carries_output(c):
                            piece = c.get("text") if "text" in c else c["delta"].get("content")
                            now = time.perf_counter()
                            if last is None:
                                res.ttft = now - t0
                            else:
                                res.itl.append(now - last)
                            last = now
                            pieces.append(piece or "")
        except asyncio.TimeoutError:
            res.error = f"stalled: no bytes for {self.stall_s:g} s" + (" after the first token" if last else "")
            return res
        except Exception as e:                      # a benchmark reports failures, it does not stop
            res.error = f"{type(e).__name__}: {e}"
            return res
        res.e2e = time.perf_counter() - t0
        res.text = "".join(pieces)
        res.ok = last is not None
        if not res.ok:
            res.error = "no output"
        return res

    async def _send_whole(self, path: str, body: dict, res: Result, t0: float) -> Result:
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        try:
            async with self._client().post(self.base + path, json=body) as r:
                if r.status != 200:
                    res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                    return res
                out = await r.json()
                res.server_timing = parse_server_timing(r.headers.get("Server-Timing", ""))
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"
            return res
        res.e2e = res.ttft = time.perf_counter() - t0
        _read_usage(res, out["usage"])
        c = out["choices"][0]
        res.text = c.get("text") if "text" in c else c["message"].get("content") or ""
        res.ok = True
        return res

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class EngineBackend:
    """Our `AsyncEngine` in this process, fed what the HTTP ingress would feed it: the
    same tokenizer and chat template, the same sampling parameters (`extra_body`'s
    logit bias). The difference
    between this and the `serve run` app is the cost of Ray Serve and HTTP."""

    def __init__(self, engine, extra_body: dict | None = None, stream_interval_s: float = 0.0,
                 max_chunks_per_s: float = 0.0):
        """`stream_interval_s`, `max_chunks_per_s`: the output pacing the app's replica
        asks of its engine (`AsyncEngine.generate`); 0: every step's tokens."""
        self.engine = engine
        self.pace = {"stream_interval_s": stream_interval_s, "max_chunks_per_s": max_chunks_per_s}
        self.tok = engine.tokenizer
        self.logit_bias = {int(k): v for k, v in (extra_body or {}).get("logit_bias", {}).items()}
        self._ids = 0

    async def send(self, req: Request, messages: list[dict] | None) -> Result:
        from deployments.protocol import chat_prompt_ids
        from runtime import SamplingParams

        if messages is not None:
            ids = chat_prompt_ids(self.tok, messages)
        else:
            ids = self.tok.encode(req.prompt)
        # Deltas only before the last output, as the served app's replica streams them.
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, logit_bias=self.logit_bias,
                                output_kind="delta")
        self._ids += 1
        res, last = Result(prompt_tokens=len(ids)), None
        t0 = time.perf_counter()
        try:
            async for out in self.engine.generate(None, params, f"bench-{self._ids}", prompt_token_ids=ids,
                                                  **self.pace):
                o = out.outputs[0]
                if o.delta_token_ids:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                        if out.metrics is not None:
                            res.server_timing = out.metrics.ttft_parts()
                    else:
                        res.itl.append(now - last)
                    last = now
                if out.finished:
                    res.output_tokens, res.text = len(o.token_ids), o.text
                    res.cached_tokens = out.num_cached_tokens
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"
            return res
        res.e2e = time.perf_counter() - t0
        res.ok = last is not None
        return res

    async def aclose(self) -> None:
        pass


def eos_logit_bias(tokenizer) -> dict:
    """OpenAI `logit_bias` that bans the end-of-sequence tokens: works on every server
    that honours logit_bias, so all of them produce exactly `max_tokens`."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return {"logit_bias": {str(i): -100 for i in sorted(ids)}}


# -- the run -------------------------------------------------------------------------------
def arrival_gaps(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds between `n` + 1 arrivals at `request_rate` on average: gamma-distributed with
    shape `burstiness` (`vllm bench serve`'s definition), so 1 is a Poisson process, below
    1 burstier and above 1 more even; at rate `inf` all at once. Shape 1 draws what an
    exponential draw gives, so Poisson runs repeat those of before the knob."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if request_rate == math.inf:
        return np.zeros(n)
    return np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), n)


async def run(backend, requests: list[Request], request_rate: float = math.inf,
              max_concurrency: int | None = None, seed: int = 0, progress: bool = True,
              slo: dict[str, float] | None = None, sampler=None, burstiness: float = 1.0) -> dict:
    """Send `requests` arriving at `request_rate` (`arrival_gaps`; `inf`: all at once)
    under a concurrency cap. Multi-turn requests wait for their session's previous turn
    and carry its history. `sampler`, if given, is called about twice a second during
    the run; what it returns is kept in `samples` (memory telemetry)."""
    from tqdm.asyncio import tqdm

    gaps = arrival_gaps(max(len(requests) - 1, 0), request_rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    history: dict[int, list[dict]] = {}
    turn_done: dict[tuple[int, int], asyncio.Event] = {}
    for r in requests:
        if r.session is not None:
            turn_done[(r.session, r.turn)] = asyncio.Event()
    bar = tqdm(total=len(requests), disable=not progress, file=sys.stderr, leave=False)
    results: list[Result] = [Result() for _ in requests]
    samples: list = []

    async def one(i: int, req: Request) -> None:
        messages = None
        if req.session is not None:
            if req.turn:
                await turn_done[(req.session, req.turn - 1)].wait()
            messages = history.setdefault(req.session, []) + req.messages
        async with sem:
            res = await backend.send(req, messages)
        if req.session is not None:
            history[req.session] = messages + [{"role": "assistant", "content": res.text}]
            turn_done[(req.session, req.turn)].set()
        results[i] = res
        bar.update(1)

    async def sample_loop() -> None:
        while True:
            samples.append(await asyncio.to_thread(sampler))
            await asyncio.sleep(0.5)

    sampling = asyncio.create_task(sample_loop()) if sampler else None
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    tasks = []
    for i, req in enumerate(requests):
        tasks.append(asyncio.create_task(one(i, req)))
        if i < len(gaps) and gaps[i] > 0:
            await asyncio.sleep(gaps[i])
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    client_cpu = time.process_time() - cpu0
    if sampling:
        sampling.cancel()
        samples.append(await asyncio.to_thread(sampler))
    bar.close()
    out = summarize(results, duration, slo or {})
    out.update(request_rate=None if request_rate == math.inf else request_rate,
               burstiness=burstiness, max_concurrency=max_concurrency, num_requests=len(requests),
               client_cpu_frac=client_cpu / duration if duration else None)
    if sampler:
        out["samples"] = samples
    return out


def build_workload(args, tokenizer) -> list[Request]:
    src = TextSource(tokenizer, args.seed)
    if args.workload == "random":
        return random_workload(src, args.num_prompts, args.input_len, args.output_len, args.range_ratio)
    if args.workload == "prefix":
        return prefix_workload(src, args.num_prompts, args.prefix_len, args.num_prefixes,
                               args.suffix_len, args.output_len)
    return multi_turn_workload(src, args.num_sessions, args.turns, args.input_len, args.output_len)


def print_summary(name: str, s: dict) -> None:
    ms = lambda d, k: f"{d[k] * 1e3:9.1f}" if d[k] is not None else "      n/a"  # noqa: E731
    print(f"\n==== {name} ====")
    rate = s.get("request_rate")
    arrivals = "a burst" if rate is None else f"{rate:g} req/s, burstiness {s.get('burstiness', 1.0):g}"
    print(f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s  arrivals {arrivals}")
    print(f"request throughput {s['request_throughput']:.2f} req/s   output {s['output_throughput']:.1f} tok/s"
          f"   total {s['total_token_throughput']:.1f} tok/s")
    if s["goodput"] is not None:
        print(f"goodput {s['goodput']:.2f} req/s")
    print(f"prompt tokens {s['total_input_tokens']} (cached {s['cached_prompt_tokens']})")
    print(f"{'':>8} {'mean ms':>9} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9}")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        d = s[key]
        print(f"{key[:-2].upper():>8} {ms(d, 'mean')} {ms(d, 'p50')} {ms(d, 'p95')} {ms(d, 'p99')}")
    if s.get("server_timing_s"):
        print(f"{'TTFT split':>12} {'mean ms':>9} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9}   (Server-Timing)")
        for part, d in s["server_timing_s"].items():
            print(f"{part:>12} {ms(d, 'mean')} {ms(d, 'p50')} {ms(d, 'p95')} {ms(d, 'p99')}")
    for e in s["errors"]:
        print("error:", e)


def parse_slo(items: list[str]) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:2000` (milliseconds) -> seconds."""
    out = {}
    for item in items or []:
        k, v = item.split(":")
        if k not in ("ttft", "tpot", "e2el"):
            raise SystemExit(f"unknown SLO {k!r}: use ttft, tpot or e2el")
        out[k] = float(v) / 1e3
    return out


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workload", choices=["random", "prefix", "multi-turn"], default="random")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--num-sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["http", "engine"], default="http")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="default",
                    help="served model name (http) or model path/'default' (engine and tokenizer)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer path for building prompts (default: --model)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--request-rate", type=float, default=math.inf)
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="arrivals' gamma shape: 1 Poisson, below 1 burstier, above 1 more even")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--goodput", nargs="*", default=[], metavar="SLO:MS")
    ap.add_argument("--keep-eos", action="store_true", help="let requests stop at EOS")
    ap.add_argument("--engine-arg", nargs="*", default=[], metavar="KEY=JSON",
                    help="EngineConfig fields for --backend engine, e.g. max_num_seqs=64")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    add_workload_args(ap)
    args = ap.parse_args(argv)
    if not args.burstiness > 0:
        ap.error(f"--burstiness must be > 0, got {args.burstiness}")

    from mlx_lm.utils import load_tokenizer

    from runtime.models import default_model_path

    model_path = str(default_model_path()) if args.model == "default" else args.model
    tok_path = args.tokenizer or model_path
    tokenizer = load_tokenizer(Path(tok_path)) if Path(tok_path).exists() else None
    if tokenizer is None:
        raise SystemExit(f"--tokenizer {tok_path!r} is not a local model directory")
    requests = build_workload(args, tokenizer)
    slo = parse_slo(args.goodput)

    async def go():
        extra = {} if args.keep_eos else eos_logit_bias(tokenizer)
        if args.backend == "engine":
            from runtime import AsyncEngine, EngineConfig
            kw = {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
            engine = AsyncEngine(EngineConfig(model=model_path, **kw))
            backend = EngineBackend(engine, extra)
        else:
            engine = None
            backend = HTTPBackend(args.base_url, args.model, extra, args.api_key)
        try:
            return await run(backend, requests, args.request_rate, args.max_concurrency, args.seed,
                             not args.disable_tqdm, slo, burstiness=args.burstiness)
        finally:
            await backend.aclose()
            if engine is not None:
                engine.shutdown()

    summary = asyncio.run(go())
    print_summary(f"{args.backend} {args.workload}", summary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), **summary}, indent=2))
        print(f"wrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
