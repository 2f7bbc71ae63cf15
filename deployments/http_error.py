"""The HTTP front's error, with OpenAI's error body, and OpenAI's paging of item lists
(a stored response's input items, a conversation's items)."""

from starlette.responses import JSONResponse

from .protocol import error_body

ITEMS_PAGE_MAX = 100


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


def items_page(items: list[dict], query, default_order: str = "desc") -> dict:
    """One page of `items` (each with an `id`), as OpenAI lists them: `order` (`asc` or
    `desc`), `after` (an item id: the items past it in that order) and `limit` (1 to
    100, default 20)."""
    order = query.get("order", default_order)
    if order not in ("asc", "desc"):
        raise HTTPError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= ITEMS_PAGE_MAX:
        raise HTTPError(400, f"limit must be an integer from 1 to {ITEMS_PAGE_MAX}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise HTTPError(400, f"no item with id {after!r} in this list", param="after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}
