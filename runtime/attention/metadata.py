"""Per-step attention inputs, built once by the model runner and shared by all layers.

Rows of the packed batch are tokens. Sequences are cut into groups that are attended
with one batched call each, so no Python loop runs over sequences inside a layer:
sequences with one new token (decodes, one-token chunks) first, then sequences with
several (prefill chunks). Within a kind, sequences come sorted by context length,
longest first, and a new group starts where the context falls below half the
group's longest: padding to the longest then wastes at most half of a group's
attention work, with a handful of groups per step. Prefill sequences are padded in
queries too, so they are first sorted into classes by their number of new tokens
(`query_class`): a prefix hit never waits in a whole new prompt's group, padded to
its length. A backend that reads each sequence's own context in place (a fused
kernel) pays nothing for padding, so its decodes stay one group: one kernel launch a
layer.
"""

import itertools
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

SPLIT_RATIO = 0.5
# Where MLX's fused attention builds a plan per input shape (CUDA), a prefill group of
# at most this many queries a sequence (prefix-cache hits, chat turns) is attended by two
# matmuls instead: no attention plan, and a finer grid of shapes than fused attention
# needs (`ROW_PAD_STEPS`, below), since the matmuls plan per shape too. A plan cost
# 40-66 ms for each shape a process met first; the matmuls' first call 1-9 ms, and once
# warm 1.2-2.2x fused attention's time (1.47x, +0.25 ms a layer, for 8 hits of 84 tokens
# over 2k; H200, Llama-3.2-1B geometry, `bench/prefill_plans.py`): a stall per new shape
# traded for a few milliseconds a hit step. Longer groups cost 1.4-3.4x unfused. With
# the `cuda` backend these groups go through a fused paged prefill kernel instead
# (paged_prefill.py): no plan either, and 0.34x the matmuls' time for that wave (H100).
UNFUSED_MAX_QUERIES = 128
# A longer prefill group there is padded to powers of two in sequences, queries and key
# blocks: few shapes, so few plans. Past `FINE_PAD_QUERIES` queries a sequence it is
# padded to `PAD_STEPS` sizes an octave (`padded_size`), wasting at most a quarter of
# each instead of up to half: there attention dominates the step, and powers of two gave
# three 4,160-token prompts 4 x 8,192 queries over 8,192 keys, 9.1 ms a layer against
# 3.4 at 3 x 5,120 over 5,120 (`bench/prefill_plans.py`), every time; a plan (63-71 ms
# for either) is paid once. A bare engine's cache-off TTFT p50 at 4,160-token prompts,
# 8 in flight: 400 -> 209 ms (`bench/prefix_sweep.py`; H200, Llama-3.2-1B geometry).
FINE_PAD_QUERIES = 2048
PAD_STEPS = 4
# MLX's matmuls on CUDA also build a plan for each new shape: 2.2-2.3 ms the first time a
# 1B model's projection meets a new row count, against 0.08-0.14 ms once seen, and 3.2
# against 0.2 ms for an unfused attention group (H100, `bench/shape_plans.py`).
# A step's packed rows number whatever its sequences' new tokens add up to, so nearly
# every step with prompt tokens met new shapes in all its matmuls. There, the packed
# rows and the rows computing logits are padded to `padded_rows` (`ROW_PAD_STEPS` sizes
# an octave, in steps of at most `ROW_PAD_MAX_STEP` rows: under an eighth of a small
# step's rows wasted, under 1 % of a 16k-token one's, where compute is what counts;
# about 170 sizes up to 16,384), and unfused groups to grids (a quarter at most of a
# group's queries). With ragged prompt lengths a prefix hit's first token came 17-31 %
# sooner (21.9 -> 18.1 and 21.2 -> 14.7 ms in the engine at 8 streams; H100,
# `bench/hit_profile.py --jitter 0.5`, both orders); with even ones, within noise.
ROW_PAD_STEPS = 8
ROW_PAD_MAX_STEP = 128


@dataclass
class GroupMetadata:
    """Sequences attended together; their packed rows are [row_start, row_end).

    `block_tables` is (B, max_blocks) block ids, padded with block 0; `query_pos` is
    (B, Lq) the position of each query (padding queries sit at position 0);
    `context_lens` is (B,) the number of valid keys; `mask` (B, 1, Lq, max_blocks *
    block_size) is true where a query may attend a key. `query_rows` maps the (B, Lq)
    layout onto the group's rows and `out_rows` maps back; both are None when every
    sequence has one query or there is one unpadded sequence (the layout is the packed
    order). A shape-padded prefill group (`make_group(plan_per_shape=True)`) has B, Lq
    and max_blocks rounded up to `padded_size`s; its padding sequences have context 1.
    `unfused` groups are attended without fused attention (see `UNFUSED_MAX_QUERIES`),
    or by the fused prefill kernel, which reads `seq_rows` (padding sequences: no rows).
    """

    row_start: int
    row_end: int
    block_tables: mx.array
    query_pos: mx.array
    context_lens: mx.array
    max_context_len: int
    mask: mx.array
    query_rows: mx.array | None = None
    out_rows: mx.array | None = None
    unfused: bool = False
    seq_rows: mx.array | None = None   # unfused: (B, 2) each sequence's first row and rows
    # Arrays made from the group once a step for all layers: additive masks, windowed views.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def single_query(self) -> bool:
        return self.query_pos.shape[1] == 1

    def additive_mask(self, dtype: mx.Dtype, grouped: bool = False) -> mx.array:
        """`mask` as 0 where a query may attend and `dtype`'s lowest value elsewhere,
        made once for all layers; `grouped`: shaped (B, 1, 1, Lq, S) for scores kept per
        KV head and query head of its group (`gather.attend_unfused`). MLX's fused
        attention on CUDA ran 3-4x slower with the boolean mask (H200,
        `bench/prefill_mask.py`: a prefill group of 8 prefix hits over 2k-token contexts,
        0.88 vs 0.23 ms a layer; 8 whole 2k prompts, 20.8 vs 4.6 ms)."""
        m = self._derived.get((dtype, grouped))
        if m is None:
            m = _additive(self.mask, dtype, grouped)
            self._derived[(dtype, grouped)] = m
        return m

    def windowed(self, window: int, block_size: int, dtype: mx.Dtype,
                 grouped: bool = False) -> tuple[mx.array, mx.array]:
        """A sliding-window layer's view of the group, made once for all such layers:
        (B, n) block tables and the additive mask over their keys, where each sequence's
        table starts at the block of its first query's window and its n blocks span the
        windows of all its queries. Each query sees its last `window` keys up to its own,
        as mlx-lm's sliding-window masks; the layer reads n blocks a sequence however
        long the context (a padding query sees its view's first key, so no row of the
        mask is empty)."""
        got = self._derived.get(("window", window, dtype, grouped))
        if got is None:
            qpos = self.query_pos
            b, lq = qpos.shape
            big = mx.array(np.iinfo(np.int32).max, qpos.dtype)
            first = mx.min(mx.where(qpos > 0, qpos, big), axis=1)
            first = mx.where(first == big, 0, first)
            start = mx.maximum(first - window + 1, 0) // block_size               # (B,)
            idx, tables = self._tables_from(start, window - 1 + lq, block_size)
            keys = (idx[:, :, None] * block_size + mx.arange(block_size, dtype=idx.dtype)).reshape(b, 1, 1, -1)
            q = qpos[:, None, :, None]
            allowed = (keys <= q) & (keys > q - window)
            allowed = allowed | ((q == 0) & (keys == (start * block_size)[:, None, None, None]))
            got = tables, _additive(allowed, dtype, grouped)
            self._derived[("window", window, dtype, grouped)] = got
        return got

    def windowed_decode(self, window: int, block_size: int) -> tuple[mx.array, mx.array, mx.array, int]:
        """A sliding-window layer's view of a one-query group for the fused decode
        kernel, made once for all such layers: (B, n) block tables from the block of
        each sequence's window start, each sequence's keys in that view, its first key
        in the window, and the most keys any view holds. The query at position p sees
        keys (p - window, p], as `windowed`, and n blocks however long the context."""
        got = self._derived.get(("window_decode", window))
        if got is None:
            start_key = mx.maximum(self.context_lens - window, 0)
            start = start_key // block_size                                          # (B,)
            _, tables = self._tables_from(start, window, block_size)
            offset = start * block_size
            got = (tables, self.context_lens - offset, start_key - offset,
                   min(self.max_context_len, tables.shape[1] * block_size))
            self._derived[("window_decode", window)] = got
        return got

    def _tables_from(self, start: mx.array, span: int, block_size: int) -> tuple[mx.array, mx.array]:
        """Each sequence's table from its block `start` (B,) on, n blocks wide: enough
        for `span` keys from any offset in the first. Returns the (B, n) indices into the
        tables and the block ids there (indices clipped to the table's width; the ones
        past it fall beyond every context and are never attended)."""
        width = self.block_tables.shape[1]
        n = min(width, -(-span // block_size) + 1)
        idx = start[:, None] + mx.arange(n, dtype=start.dtype)[None]
        return idx, mx.take_along_axis(self.block_tables, mx.minimum(idx, width - 1), axis=1)


def _additive(allowed: mx.array, dtype: mx.Dtype, grouped: bool) -> mx.array:
    m = mx.where(allowed, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))
    return m[:, :, None] if grouped else m


@dataclass
class AttentionMetadata:
    positions: mx.array          # (T,) rope offset of each packed token
    slot_mapping: mx.array       # (T,) flat KV slot each new token is written to
    groups: list[GroupMetadata]
    block_size: int
    pad_rows: int = 0            # the last rows of T pad the batch: in no group, attended to zero
    # The same step for layers whose K/V live in window slots (`build_metadata(slot_of=)`):
    # its tables and KV slots are these mapped through `slot_of`, the rest is shared.
    window: "AttentionMetadata | None" = None


def query_class(num_tokens: int) -> int:
    """Prefill sequences of one class are grouped together: up to `UNFUSED_MAX_QUERIES`
    new tokens (prefix hits, chat turns: on CUDA their group stays unfused), then
    power-of-two ranges above it, within which padding to the longest wastes at most
    half of a group's queries. Padded to a 2,112-token prompt beside them, 8 hits of 84
    tokens would do 25x their own attention work; on the CPU a wave of 4 hits and a
    1k-token prompt took 3.4x as long grouped by context alone (`bench/mixed_prefill.py`)."""
    return (max(num_tokens, UNFUSED_MAX_QUERIES) - 1).bit_length()


def sort_key(num_tokens: int, context_len: int) -> tuple[bool, int, int]:
    """The order the runner needs its sequences in: decodes, then prefill by query
    class, longest first; each by context, longest first. Decodes, most of every step,
    skip the class: it is the same for all of them."""
    if num_tokens == 1:
        return (False, 0, -context_len)
    return (True, -query_class(num_tokens), -context_len)


def _group_bounds(lengths: list[int], ctx: np.ndarray, split_decodes: bool) -> list[tuple[int, int]]:
    bounds, start = [], 0
    ctx = ctx.tolist()   # Python ints: numpy scalar compares cost ~10x more in this loop
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or (lengths[i] == 1) != (lengths[start] == 1) \
                or (lengths[i] != 1 and query_class(lengths[i]) != query_class(lengths[start])) \
                or ((split_decodes or lengths[i] != 1) and ctx[i] < SPLIT_RATIO * ctx[start]):
            bounds.append((start, i))
            start = i
    return bounds


def padded_size(n: int, least: int, steps: int, max_step: int | None = None) -> int:
    """The smallest size at or above `n` and `least` on a grid of `steps` sizes an octave
    (multiples of 2^k / steps in (2^(k-1), 2^k]); `steps` 1 gives the power of two.
    `max_step` caps the grid's step: past it, sizes are its multiples."""
    n = max(n, least)
    quantum = max(1, (1 << (n - 1).bit_length()) // (2 * steps))
    if max_step is not None:
        quantum = min(quantum, max_step)
    return -(-n // quantum) * quantum


def padded_rows(n: int, least: int = 16) -> int:
    """A step's row count on the grid of row counts (see `ROW_PAD_STEPS`)."""
    return padded_size(n, least, ROW_PAD_STEPS, ROW_PAD_MAX_STEP)


def flatten(tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Block tables as one flat array of block ids, and each table's width."""
    widths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    return np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(widths.sum())), widths


def padded_tables(blocks: np.ndarray, widths: np.ndarray, rows: int, width: int) -> np.ndarray:
    """(rows, width) int32 block tables from `flatten`'s output: each sequence's blocks,
    then block 0; rows past the sequences are all block 0."""
    bt = np.zeros((rows, width), dtype=np.int32)
    bt[:len(widths)][np.arange(width)[None] < widths[:, None]] = blocks
    return bt


def causal_mask(query_pos: mx.array, width: int, block_size: int) -> mx.array:
    """(B, 1, Lq, width * block_size): true where the query at (b, q) may see key k."""
    keys = mx.arange(width * block_size)
    return (keys[None, None, :] <= query_pos[:, :, None])[:, None]


def make_group(blocks, widths, starts, lengths, ctx, row0, block_size,
               plan_per_shape: bool = False, unfused_max_queries: int | None = None,
               pad_steps: int | None = None) -> GroupMetadata:
    """One group: sequences' block tables (flat, with widths: `flatten`), first new
    positions, new-token counts and context lengths (a numpy array), its first packed
    row.

    `plan_per_shape` says MLX's fused attention builds a plan per input shape (CUDA: 40
    ms to a second for each new one), and ragged prefill would bring new shapes every
    step. A multi-token (prefill) group of up to `unfused_max_queries` (by default
    `UNFUSED_MAX_QUERIES`) queries a sequence is then `unfused`; a longer one is padded
    in sequences, queries and key blocks to powers of two, and past `FINE_PAD_QUERIES`
    to `padded_size`s of `pad_steps` (by default `PAD_STEPS`) sizes an octave. Padding
    queries sit at position 0 and see key 0; their outputs are dropped through
    `out_rows`. An unfused group is padded too, in sequences to a power of two, in
    queries and key blocks to finer grids (`ROW_PAD_STEPS`): its matmuls plan per shape.
    Metal and CPU pay nothing per shape, so there padding would only add work."""
    n = len(lengths)
    lq = max(lengths)
    rows_n, lq_n, width = n, lq, int(widths.max())
    limit = UNFUSED_MAX_QUERIES if unfused_max_queries is None else unfused_max_queries
    unfused = plan_per_shape and 1 < lq <= limit
    if unfused:   # its matmuls plan per shape too: a grid
        rows_n, lq_n = padded_size(n, 1, 1), padded_size(lq, 16, PAD_STEPS)
        width = padded_size(width, 4, ROW_PAD_STEPS)
    elif plan_per_shape and lq > max(1, limit):
        steps = PAD_STEPS if pad_steps is None else pad_steps
        if lq <= FINE_PAD_QUERIES:
            steps = 1
        rows_n, lq_n, width = padded_size(n, 1, steps), padded_size(lq, 16, steps), padded_size(width, 4, steps)
    bt = padded_tables(blocks, widths, rows_n, width)
    lens = np.asarray(lengths)
    valid = np.zeros((rows_n, lq_n), dtype=bool)
    valid[:n] = np.arange(lq_n)[None] < lens[:, None]
    qpos = np.zeros((rows_n, lq_n), dtype=np.int32)
    qpos[:n] = np.asarray(starts, dtype=np.int32)[:, None] + np.arange(lq_n, dtype=np.int32)[None]
    qpos[~valid] = 0
    qrows = out_rows = None
    if lq > 1 and (n > 1 or lq_n != lq or rows_n != n):
        q = np.zeros((rows_n, lq_n), dtype=np.int32)
        q[valid] = np.arange(int(lens.sum()), dtype=np.int32)   # row-major: each sequence's rows in order
        out_rows = mx.array(np.flatnonzero(valid.reshape(-1)).astype(np.int32))
        qrows = mx.array(q)
    qpos_m = mx.array(qpos)
    context = np.ones(rows_n, dtype=np.int32)
    context[:n] = ctx
    seq_rows = None
    if unfused:
        sr = np.zeros((rows_n, 2), dtype=np.int32)
        sr[:n, 0] = np.cumsum(lens) - lens
        sr[:n, 1] = lens
        seq_rows = mx.array(sr)
    return GroupMetadata(
        row_start=row0, row_end=row0 + int(lens.sum()),
        block_tables=mx.array(bt), query_pos=qpos_m,
        context_lens=mx.array(context), max_context_len=int(ctx.max()),
        mask=causal_mask(qpos_m, width, block_size),
        query_rows=qrows, out_rows=out_rows, unfused=unfused, seq_rows=seq_rows,
    )


def build_metadata(block_tables: list[list[int]], starts: list[int], lengths: list[int],
                   block_size: int, split_decodes: bool = True,
                   plan_per_shape: bool = False, unfused_max_queries: int | None = None,
                   pad_steps: int | None = None, pad_rows: int = 0, scratch_slot: int = 0,
                   slot_of: np.ndarray | None = None, window_scratch_slot: int = 0,
                   window_only: bool = False) -> AttentionMetadata:
    """Sequences must come in `sort_key` order. `split_decodes=False` keeps all
    one-token sequences in one group, for backends that do not pad; `plan_per_shape`
    pads long prefill groups to a few shapes an octave and attends short ones unfused
    (see `make_group`). `pad_rows` rows after the sequences' pad the batch: they sit at
    position 0 and write their K/V to `scratch_slot`. `slot_of`: the block ids' window
    slots (`WindowSlots.slot_of`): the result's `window` is then the step for layers
    whose K/V live there (pad rows write to `window_scratch_slot`), its groups the same
    but for their tables; `window_only` returns that step alone, without building the
    main one (the last layer's sampling rows, where that layer slides). Vectorized over
    tokens: the per-sequence Python work is flattening the block tables, once."""
    lens = np.asarray(lengths, dtype=np.int64)
    ctx = np.asarray(starts, dtype=np.int64) + lens
    row_of = np.concatenate([[0], np.cumsum(lens)])
    seq_of_row = np.repeat(np.arange(len(lens)), lens)
    positions = (np.arange(row_of[-1]) - row_of[:-1][seq_of_row] + np.asarray(starts)[seq_of_row])
    flat, widths = flatten(block_tables)
    if window_only:
        flat, scratch_slot, slot_of = slot_of[flat].astype(np.int64), window_scratch_slot, None
    table_at = np.concatenate([[0], np.cumsum(widths)])
    block_of_row = table_at[:-1][seq_of_row] + positions // block_size
    bounds = _group_bounds(lengths, ctx, split_decodes)
    groups = [make_group(flat[table_at[a]:table_at[b]], widths[a:b], starts[a:b], lengths[a:b], ctx[a:b],
                         int(row_of[a]), block_size, plan_per_shape, unfused_max_queries, pad_steps)
              for a, b in bounds]
    positions = _padded(positions.astype(np.int32), pad_rows, 0)
    positions_m = mx.array(positions)

    def step(blocks: np.ndarray, groups_: list[GroupMetadata], scratch: int) -> AttentionMetadata:
        slots = (blocks[block_of_row] * block_size + positions[:len(block_of_row)] % block_size).astype(np.int32)
        return AttentionMetadata(positions_m, mx.array(_padded(slots, pad_rows, scratch)), groups_, block_size,
                                 pad_rows)

    meta = step(flat, groups, scratch_slot)
    if slot_of is not None:
        mapped = slot_of[flat].astype(np.int64)
        meta.window = step(mapped, [
            replace(g, block_tables=mx.array(padded_tables(mapped[table_at[a]:table_at[b]], widths[a:b],
                                                           *g.block_tables.shape)))
            for g, (a, b) in zip(groups, bounds)], window_scratch_slot)
    return meta


def _padded(a: np.ndarray, pad: int, value: int) -> np.ndarray:
    return np.concatenate([a, np.full(pad, value, a.dtype)]) if pad else a
