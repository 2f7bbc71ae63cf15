"""Start and stop a real `serve run` for tests, on 127.0.0.1 and a free port."""

import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int, low: int = 20000, high: int = 29000) -> int:
    """The first of `n` consecutive ports that are free on 127.0.0.1 now."""
    rng = random.Random()
    for _ in range(200):
        start = rng.randrange(low, high - n)
        socks = []
        try:
            for p in range(start, start + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in [{low}, {high})")


def direct_ingress_env(low: int, high: int) -> dict[str, str]:
    """Ray Serve's direct-ingress settings, read where Ray's processes start: on, with
    the ingress replicas' HTTP ports taken from [low, high)."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(low),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(high)}


def haproxy_env(state_dir: str) -> dict[str, str]:
    """Ray Serve's HAProxy mode (an HAProxy process takes the HTTP port and balances over
    the ingress replicas' direct-ingress ports, in place of Serve's Python proxy), with
    its files in `state_dir` and its side ports free ones, so runs do not collide."""
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(Path(state_dir) / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(Path(state_dir) / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": state_dir,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(Path(state_dir) / "server-state"),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port())}


def serve_env() -> dict:
    env = dict(os.environ)
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


class ServeRun:
    """`serve run CONFIG` in its own process group; `base_urls[app]` once ready.

    The free port is picked before Ray starts, and Ray's own workers can take it in
    between; the proxy then fails to bind and `serve run` exits. That start is retried
    on a new port."""

    ATTEMPTS = 3
    INGRESS_PORTS = 4   # under HAProxy, room for this many replicas answering HTTP

    def __init__(self, applications: list[dict], timeout: float = 180.0, front: str = "proxy",
                 env: dict | None = None, pgids: set[int] | None = None):
        """`front`: what answers HTTP. "proxy": Serve's proxy, as shipped. "direct": Ray
        Serve's direct ingress (the one ingress replica serves HTTP itself, on the port
        picked here, so requests bypass the proxy Serve still starts). "haproxy": Serve's
        HAProxy mode (HAProxy on the HTTP port, in front of the ingress replicas' own
        ports; no Python proxy on the request path). "grpc": Serve's proxy, calling the
        replicas over gRPC instead of Ray actor calls (`RAY_SERVE_PROXY_USE_GRPC=1`).
        `env`: more environment for `serve run` and the Ray processes it starts.
        `pgids`: a set that holds `serve run`'s process group from its start until it is
        stopped, for a caller that must kill what is left if its own cleanup hangs."""
        if front not in ("proxy", "direct", "haproxy", "grpc"):
            raise ValueError(f"front: {front!r}")
        self.pgids = pgids if pgids is not None else set()
        for attempt in range(self.ATTEMPTS):
            try:
                self._start(applications, timeout, front, env or {})
                return
            except RuntimeError as e:
                if "Failed to bind to address" not in str(e) or attempt == self.ATTEMPTS - 1:
                    raise

    def _start(self, applications: list[dict], timeout: float, front: str, extra_env: dict) -> None:
        self.port = proxy_port = free_port()
        env = {**serve_env(), **extra_env}
        self.dir = tempfile.mkdtemp(prefix="mps-serve-")
        if front == "grpc":
            env["RAY_SERVE_PROXY_USE_GRPC"] = "1"
        elif front != "proxy":   # the ingress replicas' own ports; Serve's proxy keeps its own
            n = 1 if front == "direct" else self.INGRESS_PORTS
            ingress_port = free_port_range(n)
            while ingress_port <= proxy_port < ingress_port + n:
                ingress_port = free_port_range(n)
            env.update(direct_ingress_env(ingress_port, ingress_port + n))
            if front == "direct":
                self.port = ingress_port
            else:
                env.update(haproxy_env(self.dir))
        cfg = {"proxy_location": "HeadOnly",
               "http_options": {"host": "127.0.0.1", "port": proxy_port},
               "applications": applications}
        self.config = Path(self.dir) / "config.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.log = open(Path(self.dir) / "serve.log", "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(["serve", "run", str(self.config)], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pgids.add(self.proc.pid)
        self.base = f"http://127.0.0.1:{self.port}"
        self.urls = {a["name"]: self.base + a["route_prefix"].rstrip("/") for a in applications}
        deadline = t0 + timeout
        pending = set(self.urls.values())
        try:
            while pending and time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    self.log.close()
                    raise RuntimeError(f"serve run exited: {self.tail()}")
                for url in list(pending):
                    try:
                        if httpx.get(url + "/health", timeout=2).status_code == 200:
                            pending.discard(url)
                    except httpx.HTTPError:
                        pass
                time.sleep(0.5)
        except BaseException:   # stopped while starting (SIGTERM, Ctrl-C): stop what was started
            self.stop()
            raise
        if pending:
            self.stop()
            raise TimeoutError(f"serve run not ready in {timeout}s: {self.tail()}")
        self.startup_s = time.monotonic() - t0

    def tail(self, n: int = 4000) -> str:
        if not self.log.closed:
            self.log.flush()
        return (Path(self.dir) / "serve.log").read_text()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._end_session()
        self.pgids.discard(self.proc.pid)
        if not self.log.closed:
            self.log.close()

    def _end_session(self, timeout: float = 30.0) -> None:
        """Stop what is left of `serve run`'s session. Ray's workers run in process groups
        of their own inside it and end when their raylet does, but a process one of them
        started can outlive them: HAProxy, in HAProxy mode, restarted on a config reload
        while Serve shut down."""
        t0 = time.monotonic()
        while pids := live_pids("-s", str(self.proc.pid)):
            waited = time.monotonic() - t0
            if waited > timeout:
                raise RuntimeError(f"processes of serve run's session outlived it: {pids}")
            sig = signal.SIGTERM if waited < timeout / 2 else signal.SIGKILL
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)


def live_pids(*pgrep_args: str) -> list[int]:
    """`pgrep`'s matches that are still running: a zombie has ended, though an orphan's
    may wait to be reaped by an init that does not reap."""
    pids = subprocess.run(["pgrep", *pgrep_args], capture_output=True, text=True).stdout.split()
    if not pids:
        return []
    ps = subprocess.run(["ps", "-o", "pid=,stat=", "-p", ",".join(pids)], capture_output=True, text=True).stdout
    return [int(pid) for pid, stat in (line.split()[:2] for line in ps.splitlines() if line.strip())
            if not stat.startswith("Z") and int(pid) != os.getpid()]


def metric(text: str, name: str) -> float | None:
    """The first sample of `mlx_paged_serve:<name>` in Prometheus text, or None."""
    m = re.search(rf"^mlx_paged_serve:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def replica_pids(app_name: str) -> list[int]:
    """PIDs of the replica processes that hold an engine in one Serve application:
    `LLMServer` replicas, or the colocated app's `OpenAIServer` ones."""
    return live_pids("-f", f"ServeReplica:{app_name}:(LLMServer|OpenAIServer)")


def exited(pid: int, timeout: float) -> bool:
    """Whether process `pid` ends within `timeout` seconds (a zombie has ended: its
    new parent may not reap it at once)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if Path("/proc/self").exists() and \
                    Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


def engine_pids(replica_pid: int) -> list[int]:
    """PIDs of the engine processes a replica started."""
    return live_pids("-P", str(replica_pid), "-f", "runtime.engine_process")


def process_env(pid: int) -> dict[str, str]:
    """The environment process `pid` started with (Linux: /proc)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(e.split("=", 1) for e in raw.split("\0") if "=" in e)


def app(name: str, route_prefix: str, **args) -> dict:
    return {"name": name, "route_prefix": route_prefix, "import_path": "deployments.app:build_app",
            "args": args}
