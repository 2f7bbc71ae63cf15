"""The engine loop in a process of its own, so a server's own Python work never waits
for the engine's, nor the engine's for the server's.

A server process has one GIL. Ray Serve's per-message work for hundreds of streams and
the engine's host work of a step (scheduling, building the graph, processing tokens,
milliseconds at hundreds of sequences) take turns on it, and each slows the other.
Here the `EngineLoop` runs in a child (`python -m runtime.engine_process`), started
with a socket to its parent: commands go down, each loop turn's events come up as one
pickled message. The child exits when that socket closes, so it never outlives the
server, whatever ended it.
"""

import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Callable

from .config import EngineConfig
from .engine_loop import EngineLoop

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.5


class EngineProcess:
    """Parent side: starts the child, sends commands from any thread, and hands each
    message of events to `on_events` on a receiving thread."""

    def __init__(self, config: EngineConfig, on_events: Callable[[list], None],
                 on_start: Callable[[], None] | None = None, env: dict[str, str] | None = None):
        """`env`: variables the child gets beside (or instead of) this process's."""
        parent, child = socket.socketpair()
        env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.engine_process", str(child.fileno())],
                                     pass_fds=(child.fileno(),), env=env)
        child.close()
        self._conn = Connection(parent.detach())
        self._conn.send((config, on_start))
        self._outbox: queue.Queue = queue.Queue()
        self._on_events = on_events
        self._sender = threading.Thread(target=self._send_loop, name="engine-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name="engine-recv", daemon=True)
        self._sender.start()
        self._receiver.start()

    def send(self, cmd: tuple) -> None:
        """Never blocks: a thread writes to the socket, which fills while the child steps."""
        self._outbox.put(cmd)

    def alive(self) -> bool:
        return self.proc.poll() is None and self._receiver.is_alive()

    def kill(self) -> None:
        """End the child now (a stalled one never reads `stop`); the receiver then reports
        it dead."""
        self.proc.kill()

    def close(self, timeout: float) -> None:
        """Ask the child to stop, then make sure it has."""
        self.send(("stop",))
        self._outbox.put(None)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._receiver.join(timeout)

    def _send_loop(self) -> None:
        while (cmd := self._outbox.get()) is not None:
            try:
                self._conn.send(cmd)
            except OSError:
                return   # the child is gone; the receiver reports it

    def _recv_loop(self) -> None:
        while True:
            try:
                events = self._conn.recv()
            except (EOFError, OSError):
                break
            self._on_events(events)
            if events and events[-1][0] in ("stopped", "dead", "start_failed"):
                return
        code = self.proc.wait()
        self._on_events([("dead", f"the engine process exited with code {code}")])


def _portable(events: list) -> list:
    """Events with every exception that pickle cannot carry replaced by its repr."""
    def fix(x):
        if isinstance(x, BaseException):
            try:
                pickle.dumps(x)
            except Exception:
                return RuntimeError(repr(x))
        return x
    return [tuple(fix(x) for x in ev) for ev in events]


def _child(fd: int) -> None:
    conn = Connection(fd)
    config, on_start = conn.recv()
    stop = [("stop",)]

    def recv(block: bool) -> list:
        cmds = []
        try:
            if conn.poll(IDLE_POLL_S if block else 0):
                cmds.append(conn.recv())
                while conn.poll(0):
                    cmds.append(conn.recv())
        except (EOFError, OSError):
            return cmds + stop       # the server is gone
        return cmds

    def emit(events: list) -> None:
        try:
            conn.send(events)
        except (pickle.PicklingError, TypeError, AttributeError):
            conn.send(_portable(events))

    try:
        EngineLoop(config, on_start).run(recv, emit)
    except (EOFError, OSError):
        pass   # the server went away mid-send


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _child(int(sys.argv[1]))
