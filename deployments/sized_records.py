"""`SizedRecords`: records by id, each with an owner and a size in bytes, within a bound
on their count and one on their bytes. The store replica keeps its responses,
conversations and chat completions this way (response_store.py, conversation_store.py,
chat_store.py).

Records stay in the order they were put, or, with `touch`, in the order they were last
found; past either bound the first ones go. A record (`owner`, `size` attributes) is
found only by its owner.
"""

from collections import OrderedDict
from typing import Generic, Iterator, TypeVar

R = TypeVar("R")


class SizedRecords(Generic[R]):
    def __init__(self, max_count: int, max_bytes: int, touch: bool):
        self.max_count, self.max_bytes, self.touch = max_count, max_bytes, touch
        self._records: OrderedDict[str, R] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def values(self) -> Iterator[R]:
        return iter(self._records.values())

    def peek(self, key: str) -> R | None:
        """The record under `key`, whoever owns it, left where it is."""
        return self._records.get(key)

    def find(self, owner: str | None, key: str) -> R | None:
        """`owner`'s record under `key` (with `touch`, now the last to go), or None."""
        record = self._records.get(key)
        if record is None or record.owner != owner:
            return None
        if self.touch:
            self._records.move_to_end(key)
        return record

    def put(self, key: str, record: R) -> bool:
        """Keep `record` under `key`, in place of any there, as the last to go; False, and
        nothing changed, if it alone is larger than `max_bytes`."""
        if record.size > self.max_bytes:
            return False
        self.drop(key)
        self._records[key] = record
        self.nbytes += record.size
        self._evict()
        return True

    def resize(self, key: str, size: int) -> None:
        """The record under `key` now takes `size` bytes (at most `max_bytes`)."""
        record = self._records[key]
        self.nbytes += size - record.size
        record.size = size
        self._evict()

    def remove(self, owner: str | None, key: str) -> bool:
        """Drop `owner`'s record under `key`; False if it has none there."""
        if self.find(owner, key) is None:
            return False
        self.drop(key)
        return True

    def drop(self, key: str) -> None:
        record = self._records.pop(key, None)
        if record is not None:
            self.nbytes -= record.size

    def _evict(self) -> None:
        while len(self._records) > self.max_count or self.nbytes > self.max_bytes:
            self.drop(next(iter(self._records)))
