"""`OutputPacer`: which of a step's outputs leave the engine loop now, and which wait
to be merged into a later one.

A served stream gets its first token at once, then at most one chunk per interval
(`AsyncEngine.generate`'s `stream_interval_s`, growing with the live streams under
`max_chunks_per_s`), and its last output at once. Merging where the caller reads still
sent every request's output of every step across to the server: at 128 streams on the
H200, about 60 steps a second made 7,700 outputs a second for the server process to
unpickle and merge, where its streams sent about 1,000 chunks. Merged here, the engine
pickles and the server unpickles only what will be sent; and since the engine asks `due`
before it makes a running request's output, one that would be held is not made at all
(the next one carries its tokens).
"""

import time
from dataclasses import dataclass

from .outputs import RequestOutput


@dataclass
class _Pace:
    interval: float            # seconds between outputs after the first; math.inf: the last only
    max_chunks_per_s: float    # 0: no cap on all paced requests' outputs together
    due: float = 0.0
    held: RequestOutput | None = None


class OutputPacer:
    def __init__(self):
        self._paced: dict[str, _Pace] = {}

    def add(self, request_id: str, interval: float = 0.0, max_chunks_per_s: float = 0.0) -> None:
        """Pace a request's outputs; with neither an interval nor a cap every one leaves."""
        if interval > 0 or max_chunks_per_s > 0:
            self._paced[request_id] = _Pace(interval, max_chunks_per_s)

    def due(self, request_id: str) -> bool:
        """Whether a running request's next output would leave now, so that the engine
        need not make one that would only be held (`LLMEngine.output_wanted`)."""
        p = self._paced.get(request_id)
        return p is None or time.monotonic() >= p.due

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted or failed): what it held goes nowhere."""
        self._paced.pop(request_id, None)

    def release(self, outputs: list[RequestOutput], now: float) -> list[RequestOutput]:
        """The outputs to send now, each carrying what its request held before it. A
        held output waits for its request's next one, which a running request makes
        every step."""
        live = len(self._paced)
        out = []
        for o in outputs:
            p = self._paced.get(o.request_id)
            if p is None:
                out.append(o)
                continue
            if p.held is not None:
                o, p.held = p.held.absorb(o), None
            if o.finished:
                del self._paced[o.request_id]
                out.append(o)
            elif now >= p.due:
                interval = p.interval
                if p.max_chunks_per_s > 0:
                    interval = max(interval, live / p.max_chunks_per_s)
                p.due = now + interval
                out.append(o)
            else:
                p.held = o
        return out

    def __len__(self) -> int:
        return len(self._paced)
