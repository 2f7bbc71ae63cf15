"""Conversations, for OpenAI's Conversations API and the Responses API's `conversation`.

A conversation is a list of items (messages, function calls and their outputs,
reasoning) with metadata; a response made in it reads every item before its own input
and adds its input and output items when it ends. Conversations live in the app's
`ResponseStore` replica beside the stored responses, in memory, within the same kind of
bounds: at most `max_conversations`, and at most `max_bytes` of their items' JSON, the
least recently used going first. A conversation belongs to the API key that made it
(`owner`): another key neither reads, changes nor deletes it.

The methods are plain and synchronous: the store replica calls them one at a time from
its event loop (`ResponseStore.part`).
"""

import json
import time
import uuid
from dataclasses import dataclass, field

from .sized_records import SizedRecords


@dataclass
class Conversation:
    id: str
    owner: str | None
    created_at: int
    metadata: dict
    items: list[dict] = field(default_factory=list)
    size: int = 0    # bytes of the items as JSON

    def body(self) -> dict:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}


def _size(items: list[dict]) -> int:
    return sum(len(json.dumps(item)) for item in items)


class ConversationStore:
    def __init__(self, max_conversations: int, max_bytes: int):
        self.records: SizedRecords[Conversation] = SizedRecords(max_conversations, max_bytes, touch=True)

    def create(self, owner: str | None, items: list[dict], metadata: dict) -> dict | None:
        """A new conversation holding `items` (each with an id); None if they alone are
        larger than `max_bytes`."""
        conv = Conversation(f"conv_{uuid.uuid4().hex}", owner, int(time.time()), metadata, list(items), _size(items))
        return conv.body() if self.records.put(conv.id, conv) else None

    def get(self, owner: str | None, conv_id: str) -> dict | None:
        conv = self.records.find(owner, conv_id)
        return None if conv is None else conv.body()

    def update(self, owner: str | None, conv_id: str, metadata: dict) -> dict | None:
        conv = self.records.find(owner, conv_id)
        if conv is None:
            return None
        conv.metadata = metadata
        return conv.body()

    def delete(self, owner: str | None, conv_id: str) -> bool:
        return self.records.remove(owner, conv_id)

    def items(self, owner: str | None, conv_id: str) -> list[dict] | None:
        conv = self.records.find(owner, conv_id)
        return None if conv is None else list(conv.items)

    def append(self, owner: str | None, conv_id: str, items: list[dict]) -> tuple[bool, list[dict] | None]:
        """Add `items` (each with an id) at the end. Returns (whether there is such a
        conversation, the items added or None if they would grow it past `max_bytes`):
        one call tells a caller both answers it reports apart."""
        conv = self.records.find(owner, conv_id)
        if conv is None:
            return False, None
        size = conv.size + _size(items)
        if size > self.records.max_bytes:
            return True, None
        conv.items += items
        self.records.resize(conv_id, size)   # found last: the others go first
        return True, items

    def delete_item(self, owner: str | None, conv_id: str, item_id: str) -> tuple[dict | None, bool]:
        """(the conversation, or None if there is none; whether it held the item)."""
        conv = self.records.find(owner, conv_id)
        if conv is None:
            return None, False
        kept = [item for item in conv.items if item["id"] != item_id]
        if len(kept) == len(conv.items):
            return conv.body(), False
        conv.items = kept
        self.records.resize(conv_id, _size(kept))
        return conv.body(), True

    def stats(self) -> dict:
        return {"conversations": len(self.records), "conversation_bytes": self.records.nbytes}
