"""Prefix-cache-aware request routing for `LLMServer` replicas.

Each request goes to the replica that already holds the longest run of its leading
KV blocks. The router computes the same chained block hashes the engine caches under
(`runtime.kv.prefix_cache.block_hashes`, from token ids and the tenant's salt), and
matches them against two sources:

- what each replica reports through `record_routing_stats`: a bounded set of the block
  hashes in its prefix cache, and its load; for a model with sliding-window layers in
  window slots, also which of those blocks still hold their slots, so that a match is
  cut back as the replica's engine would cut the hit (`usable_hit`);
- what this router sent where recently (a bounded LRU), so a prefix family sticks to
  one replica before the next stats report arrives.

When nothing matches, or the best match is overloaded by more than
`imbalance_threshold` requests against the least-loaded replica, it falls back to
power-of-two-choices on load. Only the live candidates Serve passes in are ever
considered, so stale stats cannot route to a dead replica.
"""

import random
from collections import Counter, OrderedDict

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, ReplicaResult, RequestRouter

from runtime.kv.prefix_cache import block_hashes
from runtime.kv.window_slots import usable_hit

DEFAULT_BLOCK_SIZE = 16


def leading_matches(hashes: list[bytes], held) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, imbalance_threshold: int = 8, recent_capacity: int = 65536, **kwargs):
        self.imbalance_threshold = imbalance_threshold
        self.recent_capacity = recent_capacity
        self._recent: OrderedDict[bytes, ReplicaID] = OrderedDict()
        self._owned: Counter = Counter()      # blocks per replica in `_recent`
        self._held: dict[tuple[ReplicaID, str], tuple[dict, frozenset]] = {}
        self._pending: OrderedDict[int, list[bytes]] = OrderedDict()   # request -> its hashes
        self.rng = random.Random()

    # -- inputs ----------------------------------------------------------------------
    @staticmethod
    def _request_tokens(pending: PendingRequest | None):
        """(token ids, salt) of an `LLMServer.generate(ids, params, priority, salt)` call."""
        if pending is None or not pending.args or not isinstance(pending.args[0], list):
            return None, None
        salt = pending.args[3] if len(pending.args) > 3 else pending.kwargs.get("cache_salt")
        return pending.args[0], salt

    def _held_set(self, replica, field: str = "block_hashes") -> frozenset:
        """A reported list of hashes as a set, built once per report: each report reaches
        the router as a new stats dict, which the cache holds (so its id is not reused)."""
        stats = replica.routing_stats or {}
        cached = self._held.get((replica.replica_id, field))
        if cached is None or cached[0] is not stats:
            cached = (stats, frozenset(stats.get(field) or ()))
            self._held[(replica.replica_id, field)] = cached
        return cached[1]

    @staticmethod
    def _load(replica) -> int:
        stats = replica.routing_stats or {}
        return int(stats.get("load", 0))

    def _block_size(self, candidates) -> int:
        for r in candidates:
            bs = (r.routing_stats or {}).get("block_size")
            if bs:
                return int(bs)
        return DEFAULT_BLOCK_SIZE

    # -- routing -------------------------------------------------------------------------
    def _hashes(self, pending, candidates) -> list[bytes]:
        ids, salt = self._request_tokens(pending)
        if not ids:
            return []
        hashes = block_hashes(ids, self._block_size(candidates), salt)
        self._pending[id(pending)] = hashes
        while len(self._pending) > 4096:
            self._pending.popitem(last=False)
        return hashes

    def _match(self, hashes: list[bytes], replica, block_size: int) -> int:
        from_stats = leading_matches(hashes, self._held_set(replica))
        window = (replica.routing_stats or {}).get("window_tokens")
        if window and from_stats:
            slotted = self._held_set(replica, "window_block_hashes")
            from_stats = usable_hit(from_stats, window, block_size, lambda i: hashes[i] in slotted)
        from_recent = 0
        for h in hashes:
            if self._recent.get(h) != replica.replica_id:
                break
            from_recent += 1
        return max(from_stats, from_recent)

    def _fallback(self, candidates):
        """Power of two choices on load, in steps of `imbalance_threshold` (load reports
        lag, and a difference below the threshold is ignored when following a prefix
        too); within a step, the replica this router has sent fewer prefix blocks, so
        new prefix families spread evenly over the replicas' caches."""
        pair = self.rng.sample(candidates, min(2, len(candidates)))
        step = max(1, self.imbalance_threshold)
        return sorted(pair, key=lambda r: (self._load(r) // step, self._owned[r.replica_id]))

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if len(candidate_replicas) <= 1:
            return [candidate_replicas]
        hashes = self._hashes(pending_request, candidate_replicas) if pending_request else []
        if hashes:
            size = self._block_size(candidate_replicas)
            scored = [(self._match(hashes, r, size), -self._load(r), r) for r in candidate_replicas]
            best_n, _, best = max(scored, key=lambda t: (t[0], t[1]))
            min_load = min(self._load(r) for r in candidate_replicas)
            if best_n > 0 and self._load(best) - min_load <= self.imbalance_threshold:
                rest = sorted((r for r in candidate_replicas if r is not best), key=self._load)
                return [[best], rest]
        return [self._fallback(candidate_replicas), candidate_replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        for h in self._pending.pop(id(pending_request), []):
            old = self._recent.get(h)
            if old is not None:
                self._owned[old] -= 1
            self._recent[h] = replica_id
            self._recent.move_to_end(h)
            self._owned[replica_id] += 1
        while len(self._recent) > self.recent_capacity:
            _, old = self._recent.popitem(last=False)
            self._owned[old] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        for key in [k for k in self._held if k[0] == replica_id]:
            del self._held[key]
        self._owned.pop(replica_id, None)
        for h in [h for h, r in self._recent.items() if r == replica_id]:
            del self._recent[h]
