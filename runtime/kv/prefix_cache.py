"""Automatic prefix caching over full KV blocks.

A block's hash chains its parent's hash, its token ids and extra keys; the first
block's extra key is the request's `cache_salt`, so tenants with different salts never
share blocks. The hash is SHA-256 over bytes, stable across processes, so a router can
compute the same hashes from token ids (`block_hashes`). The cache lives as long as the
engine: blocks stay cached after their requests finish, until the pool reuses them.
"""

import hashlib
from array import array
from dataclasses import dataclass

from .block_pool import BlockPool

HASH_BYTES = 16


def hash_block(parent: bytes | None, token_ids, extra: bytes = b"") -> bytes:
    h = hashlib.sha256(parent or b"\0" * HASH_BYTES)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()[:HASH_BYTES]


def salt_bytes(cache_salt: str | None) -> bytes:
    return b"" if not cache_salt else b"salt:" + cache_salt.encode()


def extend_block_hashes(hashes: list[bytes], token_ids, block_size: int,
                        cache_salt: str | None = None) -> list[bytes]:
    """Append, in place, the hashes of the full blocks of `token_ids` not yet in `hashes`."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        extra = salt_bytes(cache_salt) if i == 0 else b""
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
    return hashes


def block_hashes(token_ids, block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """Hashes of every full block of `token_ids`: what the engine caches them under."""
    return extend_block_hashes([], token_ids, block_size, cache_salt)


@dataclass
class PrefixCacheStats:
    queries: int = 0        # lookups (one per admission)
    hits: int = 0           # lookups that found at least one block
    query_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0


class PrefixCache:
    def __init__(self, pool: BlockPool, enabled: bool = True):
        self.pool = pool
        self.enabled = enabled
        self._blocks: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def cached_hashes(self):
        return self._blocks.keys()

    def block_of(self, block_hash: bytes) -> int:
        """The block a cached hash maps to."""
        return self._blocks[block_hash]

    def lookup(self, hashes: list[bytes], num_tokens: int, block_size: int, usable=None) -> list[int]:
        """Longest run of cached blocks at the start of `hashes`, cut back by `usable`
        (hit -> the part of it that can be used), if given. Does not take refs."""
        self.stats.queries += 1
        self.stats.query_tokens += num_tokens
        if not self.enabled:
            return []
        hit = []
        for h in hashes:
            block_id = self._blocks.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        if usable is not None:
            hit = usable(hit)
        if hit:
            self.stats.hits += 1
            self.stats.hit_tokens += len(hit) * block_size
        return hit

    def insert(self, block_hash: bytes, block_id: int) -> None:
        """Publish a full block. A hash already cached keeps its first block; the
        duplicate stays private to its request and is reused first once freed."""
        if not self.enabled or block_hash in self._blocks:
            return
        self._blocks[block_hash] = block_id
        self.pool.block_hash[block_id] = block_hash

    def allocate(self) -> int:
        """Take a free block for new contents, evicting whatever it cached."""
        block_id = self.pool.pop_free()
        old = self.pool.block_hash[block_id]
        if old is not None:
            del self._blocks[old]
            self.pool.block_hash[block_id] = None
            self.stats.evictions += 1
        return block_id

    def reset(self) -> int:
        """Forget every cached block that no request holds; returns how many."""
        dropped = [h for h, b in self._blocks.items() if self.pool.ref_cnt[b] == 0]
        for h in dropped:
            self.pool.block_hash[self._blocks.pop(h)] = None
        return len(dropped)
