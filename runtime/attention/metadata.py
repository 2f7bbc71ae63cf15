"""Per-step attention inputs, built once by the model runner and shared by all layers.

Rows of the packed batch are tokens. Sequences with one new token (decodes, and
one-token prefill chunks) come first, as the "single" group; sequences with several
new tokens (prefill chunks) follow, as the "multi" group. Each group is attended with
one batched call, so no Python loop runs over sequences inside a layer.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass
class GroupMetadata:
    """A group of sequences attended together.

    `block_tables` is (B, max_blocks) block ids, padded with block 0; `query_pos` is
    (B, Lq) the position of each query token (padding queries sit at position 0);
    `context_lens` is (B,) the number of valid keys. `query_rows` maps the (B, Lq)
    query layout onto the group's packed rows, `out_rows` maps packed rows back; both
    are None when the layout already is the packed order (one token each, or one
    sequence).
    """

    block_tables: mx.array
    query_pos: mx.array
    context_lens: mx.array
    max_context_len: int
    query_rows: mx.array | None = None
    out_rows: mx.array | None = None

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]


@dataclass
class AttentionMetadata:
    positions: mx.array          # (T,) rope offset of each packed token
    slot_mapping: mx.array       # (T,) flat KV slot each new token is written to
    num_single: int              # rows [0, num_single) are one-token sequences
    single: GroupMetadata | None
    multi: GroupMetadata | None
    block_size: int


def _pad_tables(tables: list[list[int]]) -> np.ndarray:
    width = max(len(t) for t in tables)
    out = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def build_metadata(block_tables: list[list[int]], starts: list[int], lengths: list[int],
                   block_size: int) -> AttentionMetadata:
    """Sequences must come ordered single group first (`lengths[i] == 1`)."""
    num_single = 0
    while num_single < len(lengths) and lengths[num_single] == 1:
        num_single += 1
    positions = np.concatenate([np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, lengths)])
    slots = np.empty_like(positions)
    row = 0
    for table, s, n in zip(block_tables, starts, lengths):
        pos = positions[row:row + n]
        slots[row:row + n] = np.asarray(table, dtype=np.int32)[pos // block_size] * block_size + pos % block_size
        row += n

    single = multi = None
    if num_single:
        s = np.asarray(starts[:num_single], dtype=np.int32)
        single = GroupMetadata(
            block_tables=mx.array(_pad_tables(block_tables[:num_single])),
            query_pos=mx.array(s[:, None]),
            context_lens=mx.array(s + 1),
            max_context_len=int(s.max()) + 1,
        )
    if num_single < len(lengths):
        m_lens = lengths[num_single:]
        m_starts = starts[num_single:]
        width = max(m_lens)
        qpos = np.zeros((len(m_lens), width), dtype=np.int32)
        qrows = np.zeros((len(m_lens), width), dtype=np.int32)
        out_rows = np.empty(sum(m_lens), dtype=np.int32)
        r = 0
        for i, (s, n) in enumerate(zip(m_starts, m_lens)):
            qpos[i, :n] = np.arange(s, s + n)
            qrows[i, :n] = np.arange(r, r + n)
            out_rows[r:r + n] = i * width + np.arange(n)
            r += n
        ctx = np.asarray(m_starts, dtype=np.int32) + np.asarray(m_lens, dtype=np.int32)
        packed = len(m_lens) == 1
        multi = GroupMetadata(
            block_tables=mx.array(_pad_tables(block_tables[num_single:])),
            query_pos=mx.array(qpos),
            context_lens=mx.array(ctx),
            max_context_len=int(ctx.max()),
            query_rows=None if packed else mx.array(qrows),
            out_rows=None if packed else mx.array(out_rows),
        )
    return AttentionMetadata(
        positions=mx.array(positions),
        slot_mapping=mx.array(slots),
        num_single=num_single,
        single=single,
        multi=multi,
        block_size=block_size,
    )
