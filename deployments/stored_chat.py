"""OpenAI's routes to stored chat completions (chat_store.py): list them (`GET
/v1/chat/completions`, by `model` and `metadata[key]=value`, paged by `after`, `limit` and
`order`, oldest first by default), read one, replace its metadata, delete it, and list
the messages it answered (`/messages`).
"""

from typing import Awaitable, Callable

from starlette.responses import JSONResponse

from .http_error import HTTPError, items_page
from .protocol import Metadata, _Strict
from .response_store import StoreClient


class CompletionUpdate(_Strict):
    metadata: Metadata | None


def _missing(cid: str) -> HTTPError:
    return HTTPError(404, f"Chat completion with id '{cid}' not found.", code="not_found")


async def handle(store: StoreClient, owner: str | None, rest: str, method: str, query,
                 body_of: Callable[[type], Awaitable]) -> JSONResponse:
    """One request to `/v1/chat/completions` + `rest` ("", "/{id}" or "/{id}/messages")
    other than creating one; `body_of(model)` reads the JSON body as `model`."""
    parts = [p for p in rest.split("/") if p]
    route = (method, len(parts), parts[1] if len(parts) > 1 else None)
    if route == ("GET", 0, None):
        wanted = {k[len("metadata["):-1]: v for k, v in query.items() if k.startswith("metadata[") and k.endswith("]")}
        listed = await store.chat("listed", owner, query.get("model"), wanted)
        return JSONResponse(items_page(listed, query, default_order="asc"))
    cid = parts[0] if parts else ""
    if route == ("GET", 1, None):
        completion = await store.chat("get", owner, cid)
    elif route == ("POST", 1, None):
        body = await body_of(CompletionUpdate)
        completion = await store.chat("update", owner, cid, body.metadata or {})
    elif route == ("DELETE", 1, None):
        if not await store.chat("delete", owner, cid):
            raise _missing(cid)
        return JSONResponse({"id": cid, "object": "chat.completion.deleted", "deleted": True})
    elif route == ("GET", 2, "messages"):
        messages = await store.chat("messages", owner, cid)
        if messages is None:
            raise _missing(cid)
        return JSONResponse(items_page(messages, query, default_order="asc"))
    else:
        raise HTTPError(404, f"no route for {method} /v1/chat/completions{rest}", code="not_found")
    if completion is None:
        raise _missing(cid)
    return JSONResponse(completion)
