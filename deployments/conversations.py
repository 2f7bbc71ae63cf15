"""OpenAI's Conversations API, under `/v1/conversations`: create a conversation (with
items and metadata), read, update its metadata, delete it; list, add, read and delete
its items. The conversations live in the app's store replica (conversation_store.py);
the Responses API's `conversation` reads and extends them (ingress.py).
"""

from typing import Awaitable, Callable

from pydantic import Field
from starlette.responses import JSONResponse

from .http_error import HTTPError, items_page
from .protocol import Metadata, _Strict
from .response_store import StoreClient
from .responses import InputItem, stored_items

MAX_ITEMS_A_REQUEST = 20     # OpenAI's bound on the items one request adds


class ConversationCreate(_Strict):
    items: list[InputItem] | None = Field(default=None, max_length=MAX_ITEMS_A_REQUEST)
    metadata: Metadata | None = None
    safety_identifier: str | None = None     # OpenAI's bookkeeping: accepted, unused


class ConversationUpdate(_Strict):
    metadata: Metadata | None


class ItemsCreate(_Strict):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS_A_REQUEST)


def missing(conv_id: str, param: str | None = None) -> HTTPError:
    """The 404 for a conversation this key has not (`param`: the request field naming it)."""
    return HTTPError(404, f"Conversation with id '{conv_id}' not found.", param=param, code="not_found")


def _too_large() -> HTTPError:
    return HTTPError(400, "the conversation would be larger than the server keeps (response_store.max_bytes)",
                     param="items", code="conversation_too_large")


def _item_list(items: list[dict]) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}


async def handle(store: StoreClient, owner: str | None, rest: str, method: str, query,
                 body_of: Callable[[type], Awaitable]) -> JSONResponse:
    """One request to `/v1/conversations` + `rest` ("", "/{id}", "/{id}/items" or
    "/{id}/items/{item_id}"); `body_of(model)` reads the request's JSON body as `model`."""
    parts = [p for p in rest.split("/") if p]
    route = (method, len(parts), parts[1] if len(parts) > 1 else None)
    if route == ("POST", 0, None):
        body = await body_of(ConversationCreate)
        conv = await store.conversation("create", owner, stored_items(body.items or []), body.metadata or {})
        if conv is None:
            raise _too_large()
        return JSONResponse(conv)
    conv_id = parts[0] if parts else ""
    if route == ("GET", 1, None):
        conv = await store.conversation("get", owner, conv_id)
    elif route == ("POST", 1, None):
        body = await body_of(ConversationUpdate)
        conv = await store.conversation("update", owner, conv_id, body.metadata or {})
    elif route == ("DELETE", 1, None):
        if not await store.conversation("delete", owner, conv_id):
            raise missing(conv_id)
        return JSONResponse({"id": conv_id, "object": "conversation.deleted", "deleted": True})
    elif route == ("GET", 2, "items"):
        items = await store.conversation("items", owner, conv_id)
        if items is None:
            raise missing(conv_id)
        return JSONResponse(items_page(items, query))
    elif route == ("POST", 2, "items"):
        body = await body_of(ItemsCreate)
        found, added = await store.conversation("append", owner, conv_id, stored_items(body.items))
        if not found:
            raise missing(conv_id)
        if added is None:
            raise _too_large()
        return JSONResponse(_item_list(added))
    elif route == ("GET", 3, "items"):
        items = await store.conversation("items", owner, conv_id)
        if items is None:
            raise missing(conv_id)
        item = next((i for i in items if i["id"] == parts[2]), None)
        if item is None:
            raise HTTPError(404, f"Item with id '{parts[2]}' not found.", code="not_found")
        return JSONResponse(item)
    elif route == ("DELETE", 3, "items"):
        conv, deleted = await store.conversation("delete_item", owner, conv_id, parts[2])
        if conv is not None and not deleted:
            raise HTTPError(404, f"Item with id '{parts[2]}' not found.", code="not_found")
    else:
        raise HTTPError(404, f"no route for {method} /v1/conversations{rest}", code="not_found")
    if conv is None:
        raise missing(conv_id)
    return JSONResponse(conv)
