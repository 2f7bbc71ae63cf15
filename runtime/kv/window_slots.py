"""Storage for sliding-window layers, lent to the main pool's blocks while windows need it.

A sliding-window layer attends each query's last W keys, so it needs a block's K/V only
while some query's window reaches the block: for a long context, a few blocks a
sequence. Full-attention layers keep their K/V in the main pool (`BlockPool` ids,
`block_manager`); sliding layers keep theirs in a pool of window slots of their own,
sized for the windows of a full batch (`num_window_slots`), not for whole contexts.

A block of the main pool has a window slot (`slot_of[block]`) or none. A running
sequence holds a reference on the slots of its blocks from the one its next query's
window starts in (`first_needed`). A slot nobody references stays with its block in
an LRU queue, K/V kept, so a later prefix hit finds the window before its end (the hit
is cut back to where it does, `covers`); it is taken for another block when the queue
runs dry of unattached slots. A block reused for new content keeps its slot, where the
new K/V are written.

This is bookkeeping only: `slot_of` maps block tables onto the window pool's arrays
(`paged_cache.KVPool`), whose last slot is scratch, the mapping of a block without one.
"""

from collections import OrderedDict

import numpy as np


def first_needed_block(position: int, window: int, block_size: int) -> int:
    """The index of the first block the window of a query at `position` reaches."""
    return max(0, position - window + 1) // block_size


def usable_hit(num_blocks: int, window: int, block_size: int, has_slot) -> int:
    """How many of a prefix hit's `num_blocks` leading blocks can be used: the hit is
    cut back to where every block the window before its end reaches has its slot
    (`has_slot(i)` for the hit's i-th block), since sliding layers attend the keys there
    and no other block holds them. The engine cuts its hits so; a router that knows
    which cached blocks have slots cuts a replica's match the same way."""
    n = num_blocks
    while n:
        start = first_needed_block(n * block_size, window, block_size)
        gap = next((i for i in range(start, n) if not has_slot(i)), None)
        if gap is None:
            return n
        # A shorter hit's window starts no later, so every hit ending after the gap
        # reaches it too: the next that can be usable ends right before it.
        n = gap
    return 0


def num_window_slots(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Slots for every running sequence's window, twice over (so that the windows before
    cached prefixes' ends stay for later hits), and a full step's new tokens: a sequence
    with n new tokens needs the blocks of [start - W + 1, start + n), at most
    (n + W - 1) / block_size + 2."""
    per_seq = (window - 1) // block_size + 3
    return 2 * max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


class WindowSlots:
    def __init__(self, num_slots: int, num_blocks: int, window: int, block_size: int):
        if num_slots < 1:
            raise ValueError("the window pool needs at least one slot")
        self.num_slots = num_slots
        self.window = window
        self.block_size = block_size
        self.scratch = num_slots
        # Indexed by block id, the main pool's scratch block (`num_blocks`) included.
        self.slot_of = np.full(num_blocks + 1, num_slots, dtype=np.int32)
        self.block_of = [-1] * num_slots
        self.ref_cnt = [0] * num_slots
        # Slots nobody references: unattached ones at the head, then attached ones, least
        # recently released first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))
        self.peak_used = 0
        self.evictions = 0   # slots taken from a block whose K/V a later hit could have used

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def first_needed(self, position: int) -> int:
        """The index of the first block the window of a query at `position` reaches."""
        return first_needed_block(position, self.window, self.block_size)

    def has_slot(self, blocks):
        """Whether a block (or each of an array of blocks) has its window slot: its K/V
        for sliding layers."""
        return self.slot_of[blocks] != self.scratch

    def covers(self, block_ids: list[int]) -> bool:
        """Whether every block has its window slot."""
        return all(self.has_slot(b) for b in block_ids)

    def can_acquire(self, block_ids: list[int], num_new: int) -> bool:
        """Whether `block_ids` (with or without slots) and `num_new` new blocks can all be
        referenced."""
        missing = sum(1 for b in block_ids if self.slot_of[b] == self.scratch) + num_new
        idle = sum(1 for b in block_ids if (s := self.slot_of[b]) != self.scratch and self.ref_cnt[s] == 0)
        return missing <= self.num_free - idle

    def acquire(self, block_ids) -> None:
        """Reference each block's slot, giving one to a block without (`can_acquire`
        first): an unattached slot, or the least recently released one. The blocks'
        own slots are taken first, so none of them is given to another."""
        missing = []
        for b in block_ids:
            s = int(self.slot_of[b])
            if s == self.scratch:
                missing.append(b)
                continue
            if self.ref_cnt[s] == 0:
                del self._free[s]
            self.ref_cnt[s] += 1
        for b in missing:
            s, _ = self._free.popitem(last=False)
            if self.block_of[s] >= 0:
                self.slot_of[self.block_of[s]] = self.scratch
                self.evictions += 1
            self.slot_of[b], self.block_of[s] = s, b
            self.ref_cnt[s] = 1
        self.peak_used = max(self.peak_used, self.num_used)

    def release(self, block_ids) -> None:
        """Drop a reference from each block's slot; an unreferenced one keeps its K/V."""
        for b in block_ids:
            s = int(self.slot_of[b])
            self.ref_cnt[s] -= 1
            assert self.ref_cnt[s] >= 0, f"window slot {s} released twice"
            if self.ref_cnt[s] == 0:
                self._free[s] = None

    def reset(self) -> None:
        """Take every unreferenced slot from its block: the window pool was written
        afresh, so none holds its block's K/V any more."""
        for s in list(self._free):
            if self.block_of[s] >= 0:
                self.slot_of[self.block_of[s]], self.block_of[s] = self.scratch, -1
                self._free.move_to_end(s, last=False)
