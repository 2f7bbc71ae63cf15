"""Pure-decode steps through `mx.compile`.

A decode step is host-bound: building the model's graph in Python and encoding a few
hundred small kernels takes longer than the device spends running them. Compiled, the
forward pass is traced once per input shape and replayed, and its elementwise chains
are fused into fewer kernels. Shapes are bucketed so that a handful of traces serve
every batch: the batch is padded to a power of two, and the block tables to a
power-of-two width when the backend reads each context in place (padding costs it
nothing), else to a multiple of `GATHER_WIDTH_STEP` blocks, since a gathering backend
reads every padded block. Padding rows write their K/V into the pool's scratch slot and
attend one key; their logits are dropped. The KV pool is the compiled function's
state, so its scatter updates stay in place: the pool is not copied per step.

A row need not be a decode: a short prefill chunk can run as one row a token
(`ModelRunner.graph_prefill_tokens`), since every row's K/V is written before any row
attends, and each row attends its sequence up to its own position.
"""

from typing import Callable

import mlx.core as mx
import numpy as np

from .attention.metadata import (AttentionMetadata, GroupMetadata, causal_mask, flatten, padded_size,
                                 padded_tables)
from .kv.paged_cache import KVPool, StepContext
from .kv.window_slots import WindowSlots

MIN_WIDTH = 4          # block-table width of the smallest bucket
GATHER_WIDTH_STEP = 8


class DecodeGraph:
    """`logits_fn(inputs (B, 1)) -> (B, V)` runs the model with `ctx.meta` as its
    attention metadata; this calls it compiled, on padded decode batches."""

    def __init__(self, logits_fn: Callable[[mx.array], mx.array], ctx: StepContext, pool: KVPool,
                 padding_free: bool, max_batch: int | None = None,
                 window: tuple[StepContext, KVPool, WindowSlots] | None = None):
        """`window`: the context, pool and slots of layers that keep their K/V in window
        slots, whose tables and KV slots are the main ones mapped through `slot_of`."""
        self._logits_fn = logits_fn
        self.padding_free = padding_free
        self.max_batch = max_batch   # larger decode steps run eagerly; None: no limit
        self.ctx = ctx
        self.block_size = pool.block_size
        self.scratch_slot = pool.scratch_slot
        self.window = window
        self._state = [pool.keys, pool.values] + ([window[1].keys, window[1].values] if window else [])
        self._fn = mx.compile(self._trace, inputs=self._state, outputs=self._state)
        self.traced: set[tuple[int, int]] = set()   # (batch, width) buckets traced so far
        self.used: set[tuple[int, int]] = set()     # buckets steps have run in
        self.warm_batch = 0                         # the largest batch bucket `warm_up` traced

    def _trace(self, tokens, positions, slots, tables, context_lens, *window_inputs):
        b, width = tables.shape
        query_pos = positions[:, None]
        mask = causal_mask(query_pos, width, self.block_size)

        def meta(slots_, tables_):
            group = GroupMetadata(row_start=0, row_end=b, block_tables=tables_, query_pos=query_pos,
                                  context_lens=context_lens, max_context_len=width * self.block_size, mask=mask)
            return AttentionMetadata(positions, slots_, [group], self.block_size)

        self.ctx.meta = meta(slots, tables)
        if self.window is not None:
            self.window[0].meta = meta(*window_inputs)
        return self._logits_fn(tokens[:, None])

    def _window_inputs(self, bt: np.ndarray, slots: np.ndarray) -> list[mx.array]:
        """The window pool's KV slots and tables: the main ones' blocks mapped through
        `slot_of` (the main scratch block's entry is the window pool's scratch)."""
        if self.window is None:
            return []
        slot_of, bs = self.window[2].slot_of, self.block_size
        return [mx.array(slot_of[slots // bs] * bs + slots % bs), mx.array(slot_of[bt])]

    def accepts(self, batch: int) -> bool:
        return self.max_batch is None or batch <= self.max_batch

    def warm(self, rows: int) -> bool:
        """Whether `rows` rows fall in a batch bucket that start-up traced."""
        return padded_size(rows, 1, 1) <= self.warm_batch

    def _width(self, blocks: int) -> int:
        if self.padding_free:
            return padded_size(blocks, MIN_WIDTH, 1)
        return -(-blocks // GATHER_WIDTH_STEP) * GATHER_WIDTH_STEP

    def warm_up(self, max_batch: int, max_blocks: int) -> int:
        """Trace the buckets a batch of up to `max_batch` sequences of up to
        `max_blocks` blocks can use, so that steps do not pay a trace (and, on a GPU,
        the compilation of its fused kernels) while serving: every width with a
        padding-free backend (a handful of powers of two), the smallest otherwise (a
        width every 8 blocks would be too many to trace up front). Every row is
        padding: only the scratch slot is written. Returns the buckets traced."""
        widths = sorted({self._width(n) for n in range(1, max_blocks + 1)})
        if not self.padding_free:
            widths = widths[:1]
        if self.max_batch is not None:
            max_batch = min(max_batch, self.max_batch)
        batches = sorted({padded_size(b, 1, 1) for b in range(1, max_batch + 1)})
        for b in batches:
            for w in widths:
                if (b, w) in self.traced:
                    continue
                zeros = mx.zeros((b,), dtype=mx.int32)
                window = [] if self.window is None else [mx.full((b,), self.window[1].scratch_slot, dtype=mx.int32),
                                                         mx.zeros((b, w), dtype=mx.int32)]
                logits = self._fn(zeros, zeros, mx.full((b,), self.scratch_slot, dtype=mx.int32),
                                  mx.zeros((b, w), dtype=mx.int32), mx.ones((b,), dtype=mx.int32), *window)
                mx.eval(logits, self._state)
                self.traced.add((b, w))
        self.warm_batch = max(self.warm_batch, batches[-1])
        return len(batches) * len(widths)

    def __call__(self, tokens: mx.array, tables: list[list[int]], positions: list[int]) -> mx.array:
        """One query per row: `tokens` (B,) the inputs, `tables` each row's block ids,
        `positions` where each input sits. Returns lazy (B, V) logits. Rows of one
        sequence (a short prefill chunk, one row a token) each attend up to their own
        position: every row's K/V is in the pool before any row attends."""
        b, bs = len(tables), self.block_size
        bp = padded_size(b, 1, 1)
        blocks, widths = flatten(tables)
        width = self._width(int(widths.max()))
        bt = padded_tables(blocks, widths, bp, width)
        pos = np.zeros(bp, dtype=np.int32)
        pos[:b] = positions
        slots = np.full(bp, self.scratch_slot, dtype=np.int32)
        slots[:b] = bt[np.arange(b), pos[:b] // bs] * bs + pos[:b] % bs
        ctx = np.ones(bp, dtype=np.int32)
        ctx[:b] = pos[:b] + 1
        if bp > b:
            tokens = mx.concatenate([tokens, mx.zeros((bp - b,), dtype=tokens.dtype)])
        logits = self._fn(tokens, mx.array(pos), mx.array(slots), mx.array(bt), mx.array(ctx),
                          *self._window_inputs(bt, slots))
        self.traced.add((bp, width))
        self.used.add((bp, width))
        return logits if bp == b else logits[:b]
