"""KV storage in MLX arrays, and the per-layer cache objects mlx-lm models talk to.

`KVPool` preallocates one K and one V array per layer it holds, shaped ((num_blocks + 1)
* block_size, kv_heads, head_dim): a block is `block_size` consecutive slots. The extra
block is scratch that no sequence owns: rows that pad a batch write their K/V there. The
main pool holds every layer, or the full-attention layers where a window pool of its own
holds the sliding-window layers' (window_slots.py).
New K/V are scattered into their slots in place (`pool[slots] = k`); attention reads
them back through block tables, never concatenating per step.

A model sees a `PagedLayerCache` per layer. Its batch is the packed token rows of one
step, shaped (T, 1): every token is its own batch row, so `offset` is the (T,) vector
of token positions, which `mx.fast.rope` takes per row. `update_and_fetch` writes the
step's K/V into the pool; the attention hook then calls `attend`, which reads the pool.
"""

from dataclasses import dataclass

import mlx.core as mx

from ..attention import AttentionMetadata, AttendFn, paged_attention


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: mx.Dtype, v_head_dim: int | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_slot = num_blocks * block_size
        slots = (num_blocks + 1) * block_size
        self.keys = [mx.zeros((slots, num_kv_heads, head_dim), dtype) for _ in range(num_layers)]
        self.values = [mx.zeros((slots, num_kv_heads, v_head_dim or head_dim), dtype)
                       for _ in range(num_layers)]
        mx.eval(self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // (self.num_blocks + 1)

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    def reset(self) -> None:
        """Fresh zeroed arrays in place of the current ones, in the same lists: after a
        failed step they may hold an unevaluable graph."""
        for arrays in (self.keys, self.values):
            for i, a in enumerate(arrays):
                arrays[i] = mx.zeros(a.shape, a.dtype)
        mx.eval(self.keys, self.values)


@dataclass
class SampledRows:
    """The rows of a step that sample, for the last layer: only their attention output
    reaches the logits. `rows` (S,) index the packed batch; `meta` has each of them as
    a one-token query over its sequence's whole context."""

    rows: mx.array
    meta: AttentionMetadata


@dataclass
class StepContext:
    """What every layer cache reads during one forward pass. `sampled`: set when some
    rows of the step do not sample (prefill chunks), so the last layer attends for the
    sampling rows alone."""

    meta: AttentionMetadata | None = None
    attend_fn: AttendFn | None = None
    sampled: SampledRows | None = None
    prefill_fn: AttendFn | None = None   # short prefill chunks, where a kernel serves them


class PagedLayerCache:
    """The mlx-lm cache interface (`offset`, `update_and_fetch`, `make_mask`) over one
    layer of the pool. `attended` counts calls of `attend`, so the runner can tell
    whether a model really routed its attention through us. `window`: a sliding-window
    layer's (its last `window` tokens), None for full attention."""

    def __init__(self, pool: KVPool, layer: int, ctx: StepContext, last: bool = False,
                 window: int | None = None):
        self.pool = pool
        self.layer = layer
        self.ctx = ctx
        self.last = last
        self.window = window
        self.attended = 0

    @property
    def offset(self) -> mx.array:
        return self.ctx.meta.positions

    def make_mask(self, *args, **kwargs):
        return None  # masks come from the block tables, in `attend`

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        t, n_kv, _, d = keys.shape
        slots = self.ctx.meta.slot_mapping
        self.pool.keys[self.layer][slots] = keys.reshape(t, n_kv, d)
        self.pool.values[self.layer][slots] = values.reshape(t, n_kv, values.shape[-1])
        return keys, values

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        """queries (T, H, 1, D) -> (T, H, 1, D). In the last layer of a step with rows that
        do not sample, the other rows' outputs reach nothing but discarded hidden
        states (their K/V are written above, from the projections alone): they are
        left zero, and a prompt chunk's attention shrinks to its last query."""
        self.attended += 1
        k, v, ctx = self.pool.keys[self.layer], self.pool.values[self.layer], self.ctx
        if not self.last or ctx.sampled is None:
            return paged_attention(queries, k, v, ctx.meta, scale, ctx.attend_fn, sinks, ctx.prefill_fn,
                                   self.window)
        rows = ctx.sampled.rows
        out = mx.zeros(queries.shape, queries.dtype)
        out[rows] = paged_attention(queries[rows], k, v, ctx.sampled.meta, scale, ctx.attend_fn, sinks,
                                    ctx.prefill_fn, self.window)
        return out

    def empty(self) -> bool:
        return False

    def is_trimmable(self) -> bool:
        return False
