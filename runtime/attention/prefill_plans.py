"""Prefill attention plans on CUDA, built while the engine has nothing to run.

MLX's fused attention on CUDA builds a cuDNN plan the first time it meets an input
shape: 39-65 ms each on an H200, against 0.5-1.7 ms for a call once built. Prefill
groups are padded to power-of-two shapes (`make_group`), so few shapes serve a
workload, but how many sequences prefill together depends on when requests arrive:
eight prompts of one shape that arrive 8 at once, or 1 then 7, or 3 then 5, meet batch
buckets 8, 1 and 4. The first use of each stalls every running sequence for a plan.

`PrefillPlans` records the (queries, key blocks) bucket of each prefill group a step
runs and queues that bucket at every other batch size; the engine loop builds queued
plans one at a time while no request runs, so the first request of each batch size
does not pay for its plan. Bounded: batch sizes up to `max_num_seqs`, no more padded
query rows than the step's token budget, and no more gathered blocks than the pool
holds. Plans live in MLX's per-thread cache: build them on the thread that runs the
steps.
"""

import logging

import mlx.core as mx
import numpy as np

from .metadata import AttentionMetadata, bucket, flatten, make_group

log = logging.getLogger(__name__)


class PrefillPlans:
    def __init__(self, attention, heads: int, head_dim: int, dtype: mx.Dtype, num_blocks: int,
                 block_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        """`attention(q, meta, scale)` is the runner's paged attention over one layer of
        its pool, run as a step runs it, so that what is built is the plan a step looks
        up."""
        self._attention = attention
        self._heads, self._head_dim, self._dtype = heads, head_dim, dtype
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._batches = [1 << i for i in range(bucket(max_num_seqs, 1).bit_length())]
        self._max_rows = bucket(max_num_batched_tokens, 1)
        self.built: set[tuple[int, int, int]] = set()    # (batch, queries, key blocks)
        self._seen: set[tuple[int, int]] = set()
        self._queue: list[tuple[int, int, int]] = []

    @property
    def pending(self) -> int:
        return len(self._queue)

    def note(self, meta: AttentionMetadata) -> None:
        """Record the prefill shapes of a step; queue the new ones' siblings."""
        for g in meta.groups:
            if g.single_query:
                continue
            b, lq = g.query_pos.shape
            width = g.block_tables.shape[1]
            self.built.add((b, lq, width))
            if (lq, width) in self._seen:
                continue
            self._seen.add((lq, width))
            self._queue += [(n, lq, width) for n in self._batches
                            if n * lq <= self._max_rows and n * width <= self._num_blocks
                            and (n, lq, width) not in self.built]

    def build_next(self) -> None:
        """Build the next queued plan (one attention call of that shape over the pool,
        reading only; tens of milliseconds), unless a step has built it meanwhile."""
        while self._queue:
            shape = self._queue.pop(0)
            if shape not in self.built:
                break
        else:
            return
        b, lq, width = shape
        self.built.add(shape)
        # Fewer sequences, queries and blocks than the bucket, as real groups have, so
        # that the padded layout (and the plan's strides) is the one a step builds.
        n = b // 2 + 1 if b > 1 else 1
        queries = lq // 2 + 1
        blocks = width // 2 + 1 if width > 4 else width
        context = blocks * self._block_size
        if queries > context:
            return
        tables = [[0] * blocks for _ in range(n)]
        group = make_group(*flatten(tables), [context - queries] * n, [queries] * n,
                           np.full(n, context), 0, self._block_size, pad=True)
        meta = AttentionMetadata(None, None, [group], self._block_size)
        q = mx.zeros((n * queries, self._heads, 1, self._head_dim), dtype=self._dtype)
        try:
            mx.eval(self._attention(q, meta, self._head_dim ** -0.5))
        except Exception:
            log.exception("building the prefill attention plan %s failed", shape)
