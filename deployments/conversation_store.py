"""Conversations, for OpenAI's Conversations API and the Responses API's `conversation`.

A conversation is a list of items (messages, function calls and their outputs,
reasoning) with metadata; a response made in it reads every item before its own input
and adds its input and output items when it ends. Conversations live in the app's
`ResponseStore` replica beside the stored responses, in memory, within the same kind of
bounds: at most `max_conversations`, and at most `max_bytes` of their items' JSON, the
least recently used going first. A conversation belongs to the API key that made it
(`owner`): another key neither reads, changes nor deletes it.

The methods are plain and synchronous: the store replica calls them one at a time from
its event loop (`ResponseStore.conversation`).
"""

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field


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


class ConversationStore:
    def __init__(self, max_conversations: int, max_bytes: int):
        self.max_conversations, self.max_bytes = max_conversations, max_bytes
        self._convs: OrderedDict[str, Conversation] = OrderedDict()
        self._bytes = 0

    def create(self, owner: str | None, items: list[dict], metadata: dict) -> dict | None:
        """A new conversation holding `items` (each with an id); None if they alone are
        larger than `max_bytes`."""
        conv = Conversation(f"conv_{uuid.uuid4().hex}", owner, int(time.time()), metadata)
        self._convs[conv.id] = conv
        if not self._add(conv, items):
            del self._convs[conv.id]
            return None
        self._evict()
        return conv.body()

    def get(self, owner: str | None, conv_id: str) -> dict | None:
        conv = self._find(owner, conv_id)
        return None if conv is None else conv.body()

    def update(self, owner: str | None, conv_id: str, metadata: dict) -> dict | None:
        conv = self._find(owner, conv_id)
        if conv is None:
            return None
        conv.metadata = metadata
        return conv.body()

    def delete(self, owner: str | None, conv_id: str) -> bool:
        conv = self._find(owner, conv_id)
        if conv is None:
            return False
        self._bytes -= conv.size
        del self._convs[conv_id]
        return True

    def items(self, owner: str | None, conv_id: str) -> list[dict] | None:
        conv = self._find(owner, conv_id)
        return None if conv is None else list(conv.items)

    def append(self, owner: str | None, conv_id: str, items: list[dict]) -> list[dict] | None:
        """Add `items` (each with an id) at the end; returns them, or None if there is no
        such conversation or it would grow past `max_bytes`."""
        conv = self._find(owner, conv_id)
        if conv is None or not self._add(conv, items):
            return None
        self._evict(keep=conv_id)
        return items

    def delete_item(self, owner: str | None, conv_id: str, item_id: str) -> tuple[dict | None, bool]:
        """(the conversation, or None if there is none; whether it held the item)."""
        conv = self._find(owner, conv_id)
        if conv is None:
            return None, False
        kept = [item for item in conv.items if item["id"] != item_id]
        if len(kept) == len(conv.items):
            return conv.body(), False
        self._bytes -= conv.size
        conv.items, conv.size = [], 0
        self._add(conv, kept)
        return conv.body(), True

    def stats(self) -> dict:
        return {"conversations": len(self._convs), "conversation_bytes": self._bytes}

    def _find(self, owner: str | None, conv_id: str) -> Conversation | None:
        conv = self._convs.get(conv_id)
        if conv is None or conv.owner != owner:
            return None
        self._convs.move_to_end(conv_id)   # in use: the last to go
        return conv

    def _add(self, conv: Conversation, items: list[dict]) -> bool:
        size = sum(len(json.dumps(item)) for item in items)
        if conv.size + size > self.max_bytes:
            return False
        conv.items += items
        conv.size += size
        self._bytes += size
        return True

    def _evict(self, keep: str | None = None) -> None:
        """The least recently used conversations go until both bounds hold; `keep` (the
        one just grown, the newest) goes last."""
        while len(self._convs) > self.max_conversations or self._bytes > self.max_bytes:
            oldest = next(iter(self._convs))
            if oldest == keep:
                break
            self._bytes -= self._convs.pop(oldest).size
