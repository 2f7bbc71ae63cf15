"""Stored chat completions, for OpenAI's routes under `/v1/chat/completions`.

A chat completion made with `store: true` (OpenAI's default is false) is kept whole, as
its client got it, with its `metadata` and the messages it answered, so it can be read
back, listed (by model and metadata, oldest first unless asked otherwise), given new
metadata or deleted, and its messages listed. Completions live in the app's
`ResponseStore` replica beside the responses and conversations, in memory, within the
same kind of bounds: at most `max_completions` and `max_bytes` of their JSON, the oldest
going first. A completion belongs to the API key that made it (`owner`).

The methods are plain and synchronous: the store replica calls them one at a time from
its event loop (`ResponseStore.part`).
"""

import json
from dataclasses import dataclass

from .sized_records import SizedRecords


@dataclass
class StoredCompletion:
    owner: str | None
    completion: dict      # the chat.completion object, with its metadata
    messages: list[dict]  # the request's messages, each with an id
    size: int


class ChatCompletionStore:
    def __init__(self, max_completions: int, max_bytes: int):
        # In the order they were made: the list reads them oldest first.
        self.records: SizedRecords[StoredCompletion] = SizedRecords(max_completions, max_bytes, touch=False)

    def put(self, owner: str | None, completion: dict, messages: list[dict]) -> bool:
        """Keep a completion (with `metadata` in it) and its request's messages; False
        if it alone is larger than `max_bytes`."""
        cid = completion["id"]
        messages = [{**m, "id": f"{cid}-{i}"} for i, m in enumerate(messages)]
        size = len(json.dumps(completion)) + len(json.dumps(messages))
        return self.records.put(cid, StoredCompletion(owner, completion, messages, size))

    def get(self, owner: str | None, cid: str) -> dict | None:
        kept = self.records.find(owner, cid)
        return None if kept is None else kept.completion

    def listed(self, owner: str | None, model: str | None, metadata: dict[str, str]) -> list[dict]:
        """This owner's completions, oldest first, of `model` (if given) and carrying
        every pair of `metadata`."""
        return [k.completion for k in self.records.values()
                if k.owner == owner and (model is None or k.completion["model"] == model)
                and all(k.completion["metadata"].get(key) == value for key, value in metadata.items())]

    def update(self, owner: str | None, cid: str, metadata: dict) -> dict | None:
        kept = self.records.find(owner, cid)
        if kept is None:
            return None
        kept.completion = {**kept.completion, "metadata": metadata}
        return kept.completion

    def delete(self, owner: str | None, cid: str) -> bool:
        return self.records.remove(owner, cid)

    def messages(self, owner: str | None, cid: str) -> list[dict] | None:
        kept = self.records.find(owner, cid)
        return None if kept is None else kept.messages

    def stats(self) -> dict:
        return {"chat_completions": len(self.records), "chat_completion_bytes": self.records.nbytes}
