"""Per-sequence block allocation over the pool and the prefix cache.

The scheduler asks three things of it: which leading blocks of a new sequence are
already cached, whether (and then how) to give a sequence slots for its next tokens,
and to free a finished or preempted sequence's blocks. A model with sliding-window
layers keeps their K/V in window slots lent to the blocks its windows reach
(`window_slots`): a block gets its slot with its room, and gives it back once no
window of its sequence reaches it.
"""

from dataclasses import dataclass

import numpy as np

from ..sequence import Sequence
from .block_pool import BlockPool
from .prefix_cache import PrefixCache, extend_block_hashes
from .window_slots import WindowSlots, usable_hit


@dataclass
class BlockUsage:
    num_total_blocks: int
    num_free_blocks: int          # ref count 0, cached or not
    num_cached_blocks: int        # blocks the prefix cache can still serve
    num_used_blocks: int          # held by at least one sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: WindowSlots | None = None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = PrefixCache(self.pool, enable_prefix_caching)
        self.window = window

    def _hashes(self, seq: Sequence) -> list[bytes]:
        known = seq.token_ids[:seq.num_known_tokens]
        return extend_block_hashes(seq.block_hashes, known, self.block_size, seq.cache_salt)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached leading blocks of a sequence that holds none. At least one token is
        left to compute, because its logits are needed to sample; all of them while its
        prompt logprobs are wanted."""
        assert not seq.block_ids
        max_blocks = (seq.num_tokens - 1) // self.block_size
        use = self.cache.enabled and not seq.wants_prompt_logprobs
        hashes = self._hashes(seq)[:max_blocks] if use else []
        return self.cache.lookup(hashes, seq.num_tokens, self.block_size, self._window_kept)

    def _window_kept(self, hit: list[int]) -> list[int]:
        """A prefix hit cut back to where the window before its end still has its slots."""
        w = self.window
        if w is None:
            return hit
        return hit[:usable_hit(len(hit), w.window, self.block_size, lambda i: w.has_slot(hit[i]))]

    def window_block_hashes(self, hashes: list[bytes]) -> list[bytes]:
        """Those of `hashes` (cached blocks') whose blocks hold their window slots (none
        without a window pool): with them a router cuts a replica's prefix match back as
        `_window_kept` cuts a hit."""
        w = self.window
        if w is None or not hashes:
            return []
        blocks = np.fromiter((self.cache.block_of(h) for h in hashes), np.int64, len(hashes))
        slotted = w.has_slot(blocks).tolist()
        return [h for h, kept in zip(hashes, slotted) if kept]

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        total = seq.num_computed_tokens + num_computed_blocks * self.block_size + num_new_tokens
        return -(-total // self.block_size) - len(seq.block_ids) - num_computed_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[int] = ()) -> bool:
        """Reserve room for `num_new_tokens` after `computed_blocks` (cache hits, for a
        sequence being admitted). False, with nothing changed, if the pool is short."""
        end = seq.num_computed_tokens + num_new_tokens
        w = self.window
        if w is not None:
            start = seq.num_computed_tokens + len(computed_blocks) * self.block_size
            if seq.block_ids:
                self._release_behind(seq, start)
            else:   # being admitted: its slots start at its prefix hit's window
                seq.window_from = w.first_needed(start)
        if not computed_blocks and end <= len(seq.block_ids) * self.block_size \
                and end // self.block_size <= seq.num_published_blocks:
            return True   # a decode inside its last block: nothing to allocate or publish
        need = max(self.num_blocks_needed(seq, num_new_tokens, len(computed_blocks)), 0)
        # Touching a free cached block takes it out of the free queue too.
        reclaimed = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free - reclaimed:
            return False
        windowed = list(computed_blocks[seq.window_from:]) if w is not None else []
        if w is not None and not w.can_acquire(windowed, need):
            return False
        for b in computed_blocks:
            self.pool.touch(b)
        seq.block_ids.extend(computed_blocks)
        seq.num_computed_tokens += len(computed_blocks) * self.block_size
        new = [self.cache.allocate() for _ in range(need)]
        seq.block_ids.extend(new)
        if w is not None:
            w.acquire(windowed + new)
        self._publish_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)
        return True

    def _release_behind(self, seq: Sequence, start: int) -> None:
        """Give back the window slots of the blocks no query from `start` on reaches: a
        sequence holds the slots of `block_ids[window_from:]`."""
        first = self.window.first_needed(start)
        if first > seq.window_from:
            self.window.release(seq.block_ids[seq.window_from:first])
            seq.window_from = first

    def _publish_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register blocks that are full once this step's tokens are written. Later
        sequences in the same step may hit them: the forward pass writes every new
        K/V of a layer before that layer's attention reads."""
        if not self.cache.enabled:
            return
        full = min(num_tokens, seq.num_known_tokens) // self.block_size
        if full <= seq.num_published_blocks:
            return
        hashes = self._hashes(seq)
        for i in range(seq.num_published_blocks, full):
            self.cache.insert(hashes[i], seq.block_ids[i])
        seq.num_published_blocks = full

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, tail first so the tail is evicted first."""
        if self.window is not None:
            self.window.release(reversed(seq.block_ids[seq.window_from:]))
            seq.window_from = 0
        self.pool.release(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0

    def usage(self) -> BlockUsage:
        return BlockUsage(
            num_total_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free,
            num_cached_blocks=len(self.cache),
            num_used_blocks=self.pool.num_used,
        )
