"""The pool of fixed-size KV blocks: ref counts and an LRU free queue.

This is bookkeeping only; the MLX arrays the ids index live in `paged_cache.KVPool`.
A block with ref count 0 sits in the free queue. If it still carries a prefix-cache
hash it keeps its contents until it is reused, so the queue is also the cache's LRU
eviction order: the head is evicted first.
"""

import os
from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # OrderedDict gives O(1) pop from the head and O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Telemetry: references summed over blocks (a block shared by k sequences counts
        # k), and the most blocks ever held at once.
        self.num_refs = 0
        self.peak_used = 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_shared_refs(self) -> int:
        """Block references served by a block some other sequence also holds: the
        blocks sharing saves right now."""
        return self.num_refs - self.num_used

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def pop_free(self) -> int:
        """Take the least recently used free block; the caller evicts its hash."""
        block_id, _ = self._free.popitem(last=False)
        self.ref_cnt[block_id] = 1
        self.num_refs += 1
        self.peak_used = max(self.peak_used, self.num_used)
        return block_id

    def touch(self, block_id: int) -> None:
        """Add a reference, taking the block out of the free queue if it was there."""
        if self.ref_cnt[block_id] == 0:
            del self._free[block_id]
            self.peak_used = max(self.peak_used, self.num_used)
        self.ref_cnt[block_id] += 1
        self.num_refs += 1

    def release(self, block_ids) -> None:
        """Drop one reference from each block. Cached blocks join the LRU tail;
        uncached ones go to the head, since nothing is lost by reusing them first."""
        for block_id in block_ids:
            self.ref_cnt[block_id] -= 1
            self.num_refs -= 1
            assert self.ref_cnt[block_id] >= 0, f"block {block_id} released twice"
            if self.ref_cnt[block_id] == 0:
                self._free[block_id] = None
                if self.block_hash[block_id] is None:
                    self._free.move_to_end(block_id, last=False)


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_size: int, block_size: int) -> int:
    """K and V, every layer, for one block of tokens."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_size * block_size


def device_memory_bytes() -> int:
    """Memory the default device may use: Metal's recommended working set, CUDA's
    memory size, or the host's RAM when the default device is the CPU (a GPU build
    running an engine with `device="cpu"` among them)."""
    import mlx.core as mx

    info = mx.device_info() if mx.default_device() == mx.gpu else {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    n = budget_bytes // bytes_per_block
    if n < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block of {bytes_per_block} bytes")
    return int(n)
