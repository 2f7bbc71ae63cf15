"""Stored responses, for the Responses API's `previous_response_id` and its routes by id.

A response made with `store` (OpenAI's default) is kept with every item it was made
from and its output items, so the next request can name it instead of sending the
conversation again, and `GET /v1/responses/{id}` (and `/input_items`) can read it back.
Each record holds its whole conversation: a chain stays readable when older responses
in it have been evicted. Records live in memory, newest kept: at most `max_responses`,
and at most `max_bytes` of their JSON; the oldest go first. A record belongs to the API
key that made it (by `owner`, the key's tenant salt): another key neither reads nor
deletes it. A background response is kept as it starts (`in_progress`) and again when it
ends; one cancelled meanwhile stays cancelled, which is how a cancel reaches the ingress
replica running it. That replica renews the response's lease while it runs (`renew`,
every second or so); a response whose lease lapsed (its replica died, or its process was
replaced) reads as failed from then on, rather than `in_progress` for ever.

The app runs one `ResponseStore` replica that every ingress replica calls, so a chain
may continue on any replica; `StoreClient` calls it through a Serve handle, or calls an
instance in the same process directly. The replica holds the app's conversations
(conversation_store.py) and stored chat completions (chat_store.py) too, each within the
same bounds.
"""

import json
from dataclasses import dataclass
from time import monotonic
from typing import Any

from .chat_store import ChatCompletionStore
from .conversation_store import ConversationStore
from .sized_records import SizedRecords

MAX_RESPONSES = 10_000
MAX_BYTES = 256 << 20
BACKGROUND_LEASE_S = 30.0
RUNNING = ("queued", "in_progress")
ORPHANED = {"code": "server_error",
            "message": "the server running this background response stopped before it finished"}
# What the replica holds beside responses, and the methods a caller may reach (`part`).
PARTS = {"conversations": (ConversationStore, {"create", "get", "update", "delete", "items", "append",
                                               "delete_item"}),
         "chat_completions": (ChatCompletionStore, {"put", "get", "listed", "update", "delete", "messages"})}


@dataclass
class StoredResponse:
    owner: str | None
    response: dict        # the response body as its client got it
    input_items: list     # every item it was made from, with ids: the chain's, then its own input
    size: int             # bytes of the two as JSON
    renewed: float = 0.0  # when its replica last said it runs (a background response)
    final: bool = False   # ended here (cancelled, or its lease lapsed): a later put does not change it

    @property
    def conversation(self) -> list:
        """What a request naming this response continues: its input items and its output."""
        return self.input_items + self.response["output"]


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES,
                 background_lease_s: float = BACKGROUND_LEASE_S):
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("max_responses and max_bytes must be at least 1")
        if background_lease_s <= 0:
            raise ValueError("background_lease_s must be positive")
        self.background_lease_s = background_lease_s
        self._records: SizedRecords[StoredResponse] = SizedRecords(max_responses, max_bytes, touch=True)
        self._parts = {name: cls(max_responses, max_bytes) for name, (cls, _) in PARTS.items()}

    # Coroutines without awaits: Serve runs them on the replica's event loop one at a
    # time, where plain methods could run on several threads at once.
    async def put(self, owner: str | None, response: dict, input_items: list) -> bool:
        """Keep a response (a background one again as it moves on); False when it alone
        is larger than `max_bytes`. A response ended here (cancelled, or failed when its
        lease lapsed) stays as it ended."""
        return self._put(owner, response, input_items)

    def _put(self, owner: str | None, response: dict, input_items: list, final: bool = False) -> bool:
        size = len(json.dumps(response)) + len(json.dumps(input_items))
        if size > self._records.max_bytes:
            return False
        kept = self._records.peek(response["id"])
        if kept is not None and kept.final:
            return True
        return self._records.put(response["id"],
                                 StoredResponse(owner, response, input_items, size, monotonic(), final))

    async def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        record = self._records.find(owner, response_id)   # a chain in use is the last to go
        if record is None:
            return None
        if (record.response.get("status") in RUNNING
                and monotonic() - record.renewed > self.background_lease_s):
            self._put(owner, {**record.response, "status": "failed", "error": ORPHANED}, record.input_items,
                      final=True)
            record = self._records.peek(response_id)
        return record

    async def renew(self, owner: str | None, response_id: str) -> StoredResponse | None:
        """A background response's replica saying it still runs it: its lease renewed,
        and the record as it reads (cancelled, failed or gone: the run should stop)."""
        record = await self.get(owner, response_id)
        if record is not None and record.response.get("status") in RUNNING:
            record.renewed = monotonic()
        return record

    async def delete(self, owner: str | None, response_id: str) -> bool:
        return self._records.remove(owner, response_id)

    async def cancel(self, owner: str | None, response_id: str) -> tuple[bool, dict] | None:
        """Mark a background response still running as cancelled: (whether it was, the
        response as it now reads); None if there is no such response of this owner."""
        record = await self.get(owner, response_id)
        if record is None:
            return None
        if record.response.get("status") not in RUNNING:
            return False, record.response
        response = {**record.response, "status": "cancelled"}
        self._put(owner, response, record.input_items, final=True)
        return True, response

    async def part(self, name: str, method: str, *args):
        """`<method>(*args)` of the part `name` of `PARTS`, on this replica's loop as
        the rest."""
        if method not in PARTS[name][1]:
            raise ValueError(f"no {name} method {method!r}")
        return getattr(self._parts[name], method)(*args)

    async def stats(self) -> dict:
        stats = {"responses": len(self._records), "bytes": self._records.nbytes}
        for part in self._parts.values():
            stats.update(part.stats())
        return stats


class StoreClient:
    """The ingress's way to a `ResponseStore`: a Serve handle to the app's store
    deployment, or an instance in this process."""

    def __init__(self, store: Any):
        self._store = store

    async def _call(self, method: str, *args):
        if isinstance(self._store, ResponseStore):
            return await getattr(self._store, method)(*args)
        return await getattr(self._store, method).remote(*args)

    async def put(self, owner: str | None, response: dict, input_items: list) -> bool:
        return await self._call("put", owner, response, input_items)

    async def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        return await self._call("get", owner, response_id)

    async def delete(self, owner: str | None, response_id: str) -> bool:
        return await self._call("delete", owner, response_id)

    async def cancel(self, owner: str | None, response_id: str) -> tuple[bool, dict] | None:
        return await self._call("cancel", owner, response_id)

    async def renew(self, owner: str | None, response_id: str) -> StoredResponse | None:
        return await self._call("renew", owner, response_id)

    async def conversation(self, method: str, *args):
        return await self._call("part", "conversations", method, *args)

    async def chat(self, method: str, *args):
        return await self._call("part", "chat_completions", method, *args)

    async def stats(self) -> dict:
        return await self._call("stats")
