"""`OpenAIIngress`: the OpenAI-compatible HTTP front, a Ray Serve deployment.

It validates requests with pydantic, applies the chat template and tokenizes (the
router needs token ids), then streams from `LLMServer` replicas through a
`DeploymentHandle`, or from the `LLMServer` held in the same replica when colocated
(llm_client.py), and writes JSON or server-sent events with starlette. Every error is
an OpenAI error body with the right status, never a stack trace.
"""

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from pydantic import ValidationError
from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from runtime.errors import InvalidRequestError, PromptTooLongError
from runtime.models.loader import load_tokenizer
from runtime.prompt_token_cache import CAPACITY_TOKENS, PromptTokenCache
from runtime.structured_output import grammar_checked, reasoning_state, think_markers

from .llm_client import LocalLLM, Overloaded, RemoteLLM
from .llm_server import set_switch_interval
from .metrics import Metrics, RequestTimer
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponseFormat,
                       TokenizeRequest, chat_prompt_ids, error_body)
from . import conversations, stored_chat
from .chat_output import ChoiceParser
from .harmony import (HarmonyParser, HarmonyTextLogprobs, answer_constraint, auto_constraint as harmony_auto,
                      harmony_markers, show_format, template_message)
from .http_error import HTTPError, items_page
from .logprobs import LogprobFormat
from .reasoning import ReasoningSplit
from .response_store import RUNNING, StoreClient
from .responses import (ResponseBody, ResponseEvents, ResponsesRequest, TextLogprobs, reasoning_tokens,
                        whole_response)
from .responses import usage as response_usage
from .tools import ToolOutput, auto_constraint

log = logging.getLogger("ray.serve")

# Tokenizing happens on threads, off the replica's event loop. A 2k-token prompt takes
# milliseconds to tokenize, and on the loop that time held up every other request's
# arrival, body and stream chunks: on the H200, prefix hits (waves of eight 2k-token
# prompts) spent 27.5 ms p50 from arrival to reaching the engine, mostly waiting for
# each other's tokenizing, and 13.7 ms with it on threads (bench/results/history.md). The
# Rust tokenizer releases the GIL, so prompts that arrive together tokenize in parallel,
# on the app's `tokenize_threads`. Prompts shorter than its `tokenize_inline_chars` cost
# less than the hop to a thread and back.
# OpenAI's routes to stored objects under an id: responses and chat completions, where the
# app keeps them (response_store.py).
STORED_PATHS = ("/v1/responses/", "/v1/chat/completions/")
BACKGROUND_POLL_S = 1.0   # how often a background response looks for a cancel made on another replica


# Fields of the chat body a Responses request becomes, by the field the client sent.
_RESPONSES_PARAMS = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens",
                     "max_tokens": "max_output_tokens", "prompt": "input"}


def _validation_error(e: ValidationError, renamed: dict[str, str] | None = None,
                      fields=()) -> HTTPError:
    """`renamed`: the client's names for fields of a body made from its own. Of the
    errors of a union's members, the deepest one says what the client got wrong (a
    content part of an unsupported type, not that content is not a string). An error
    of the whole body (a check across fields) names as its `param` the field among
    `fields` its sentence begins with, as OpenAI's errors name one."""
    err = max(e.errors(), key=lambda x: len(x.get("loc", ())))
    parts = _fields(err.get("loc", ()))
    if renamed and parts:
        parts = [renamed.get(parts[0], parts[0])]
    loc = ".".join(parts) or None
    kind, msg = err.get("type"), err.get("msg", "invalid request")
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")   # our validators' own sentences
    elif kind == "literal_error":
        msg = f"{msg}, not {err.get('input')!r}"
    elif kind == "union_tag_invalid":
        ctx = err.get("ctx") or {}
        msg = f"type {ctx.get('tag')!r} is not supported here; expected one of {ctx.get('expected_tags')}"
    elif kind == "union_tag_not_found":
        msg = "each item needs its 'type'"
    if kind == "extra_forbidden":
        msg = f"unknown field {loc!r}"
    elif loc:
        msg = f"{loc}: {msg}"
    elif (subject := msg.split(" ", 1)[0]) in fields:
        loc = (renamed or {}).get(subject, subject)
    return HTTPError(400, msg, param=loc)


_TYPE_LABELS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _fields(loc) -> list[str]:
    """A pydantic error's `loc` without list indices and the labels it gives a union's
    members (`str`, `list[TextPart]`, `NamedToolChoice`). A member picked by its `type`
    stays, as the item's type: `input.function_call.arguments`."""
    return [x for x in loc if isinstance(x, str) and not ("[" in x or x in _TYPE_LABELS or x[:1].isupper())]


def tenant_salt(api_key: str) -> str:
    """Prefix-cache salt derived on the server from the caller's API key."""
    return hashlib.sha256(b"mlx-paged-serve-tenant:" + api_key.encode()).hexdigest()[:32]


class OpenAIIngress:
    def __init__(self, llm_server, settings: dict, store=None):
        """`llm_server`: a handle to the `LLMServer` deployment, or a `LocalLLM`;
        `store`: a handle to the app's `ResponseStore` (or one), None to store nothing."""
        self.llm = llm_server if isinstance(llm_server, LocalLLM) else RemoteLLM(llm_server)
        self.store = StoreClient(store) if store is not None else None
        self._background: dict[str, asyncio.Task] = {}   # background responses running here, by id
        self.s = settings
        set_switch_interval(settings.get("switch_interval_ms"))
        self.model_name = settings["served_model_name"]
        self.api_keys = [k.encode() for k in settings.get("api_keys") or []]
        self.tokenizer = load_tokenizer(settings["model"])
        # The first encode resets any truncation or padding a tokenizer file sets (a
        # write to the shared tokenizer): done here, before threads share it.
        self.tokenizer.encode("warm-up")
        self.harmony = harmony_markers(self.tokenizer)   # their ids; None for other models
        self.lp = LogprobFormat(self.tokenizer)
        # The token(s) that end a turn's reasoning, for its `reasoning_tokens`: a thinking
        # model's end marker; a harmony turn's first message's end.
        self.reasoning_end = list(self.tokenizer.think_end_tokens or ()) if self.tokenizer.has_thinking else \
            [self.harmony["<|end|>"]] if self.harmony else None
        self._tokenize_pool = ThreadPoolExecutor(min(self.s["tokenize_threads"], os.cpu_count() or 1),
                                                 thread_name_prefix="tokenize")
        self.metrics = Metrics(self.model_name)
        capacity = settings.get("prompt_token_cache_tokens", CAPACITY_TOKENS)
        self.prompt_tokens = PromptTokenCache(self.tokenizer, capacity) if capacity else None
        self.metrics.prompt_token_cache.cache = self.prompt_tokens
        self._text_ids = self.prompt_tokens.encode if self.prompt_tokens else self.tokenizer.encode
        self._info: dict | None = None

    # -- plumbing -----------------------------------------------------------------------
    async def info(self) -> dict:
        if self._info is None:
            self._info = await self.llm.model_info()
        return self._info

    def _check_auth(self, request: Request) -> str | None:
        """Returns the caller's API key (None when keys are off); compares in constant time."""
        if not self.api_keys:
            return None
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
        ok = False
        for k in self.api_keys:
            ok |= hmac.compare_digest(key, k)
        if not ok:
            raise HTTPError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key")
        return key.decode()

    async def _body(self, request: Request, model_cls):
        """The request's body as a generation request (`model_cls`), its model and any
        structured output constraint checked."""
        body = await self._parsed(request, model_cls)
        self._check_model(body.model)
        await self._check_constraint(body)
        return body

    async def _parsed(self, request: Request, model_cls):
        """The request's JSON body as `model_cls`: 413 over the body limit, 400 if it does
        not parse or validate."""
        limit = self.s["max_request_body_bytes"]
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, f"request body of {declared} bytes exceeds the limit of {limit}")
        raw = await request.body()
        if len(raw) > limit:
            raise HTTPError(413, f"request body of {len(raw)} bytes exceeds the limit of {limit}")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise HTTPError(400, "the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        try:
            return model_cls.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e, fields=model_cls.model_fields) from None

    async def _check_constraint(self, body) -> None:
        """400 for a body whose structured output grammar llguidance rejects. A grammar
        not checked before is checked on a tokenizer thread: a large schema takes tens
        of milliseconds, during which llguidance releases the GIL and this loop serves
        other requests."""
        constraint = body.constraint() if hasattr(body, "constraint") else None
        if constraint is not None:
            await self._validate(constraint)

    async def _validate(self, constraint) -> None:
        if grammar_checked(constraint.spec):
            constraint.validate()
        else:
            await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, constraint.validate)

    def _salt(self, body, api_key: str | None) -> str | None:
        if api_key is not None:
            base = tenant_salt(api_key)
            return base if not body.cache_salt else f"{base}:{body.cache_salt}"
        return body.cache_salt

    async def _tokenize(self, make, num_chars: int) -> list[int]:
        """`make()`'s token ids, made on a tokenizer thread when the text is long."""
        if num_chars < self.s["tokenize_inline_chars"]:
            return make()
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, make)

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._tokenize(partial(self._text_ids, text, add_special_tokens=add_special_tokens), len(text))

    async def _chat_ids(self, messages: list, add_generation_prompt: bool, tools: list | None = None,
                        template_kwargs: dict | None = None, fmt: ResponseFormat | None = None) -> list[int]:
        """The chat template's token ids for `ChatMessage`s and `Tool`s (templating and
        tokenizing a long conversation takes milliseconds); 400 for messages the
        template rejects. A harmony model is shown a JSON schema `fmt` in its developer
        message."""
        plain = [m.for_template() for m in messages]
        if self.harmony:
            plain = [template_message(m) for m in plain]
            if fmt is not None and fmt.type == "json_schema":
                f = fmt.json_schema
                plain = show_format(plain, f.name, f.schema_, f.description)
        shown = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        make = partial(chat_prompt_ids, self.tokenizer, plain, add_generation_prompt, shown, template_kwargs,
                       self._text_ids)
        try:
            return await self._tokenize(make, sum(len(m["content"]) for m in plain))
        except Exception as e:
            raise HTTPError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    async def _check_prompt(self, ids: list[int], max_tokens: int | None) -> int:
        """Validates length and vocabulary; returns the effective max_tokens."""
        info = await self.info()
        limit = min(info["max_model_len"], self.s["max_prompt_tokens"] or info["max_model_len"])
        if not ids:
            raise HTTPError(400, "the prompt is empty", param="prompt")
        if len(ids) > limit:
            raise HTTPError(400, f"the prompt has {len(ids)} tokens, more than the limit of "
                                 f"{limit}", param="prompt", code="context_length_exceeded")
        self._check_vocab(ids, info["vocab_size"], "prompt")
        room = info["max_model_len"] - len(ids)
        if max_tokens is None:
            max_tokens = min(self.s["default_max_tokens"], room)
            if max_tokens < 1:
                err = PromptTooLongError(len(ids), 1, info["max_model_len"])
                raise HTTPError(400, str(err), param="prompt", code="context_length_exceeded")
        elif max_tokens > room:
            err = PromptTooLongError(len(ids), max_tokens, info["max_model_len"])
            raise HTTPError(400, str(err), param="max_tokens", code="context_length_exceeded")
        return max_tokens

    @staticmethod
    def _check_vocab(ids: list[int], vocab_size: int, param: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise HTTPError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)

    async def _stream(self, ids: list[int], params, body, salt):
        """Start one engine request; returns (first item, generator). Errors, including
        backpressure, surface here, before any byte is sent."""
        from ray.serve.exceptions import BackPressureError

        try:
            gen = self.llm.generate(ids, params, body.priority, salt, not body.stream)
            first = await gen.__anext__()
        except (BackPressureError, Overloaded):
            raise HTTPError(503, "the server is overloaded; retry shortly", type_="server_error",
                            code="overloaded", headers={"Retry-After": str(self.s["retry_after_s"])})
        if isinstance(first, dict) and "error" in first:
            raise self._item_error(first["error"])
        return first, gen

    def _item_error(self, e: dict) -> HTTPError:
        """The HTTP error for an `{"error": ...}` item of the replica's stream: 400 for a
        bad request, 503 with Retry-After for a request a failed engine step aborted."""
        if e.get("type") == "invalid_request_error":
            return HTTPError(400, e["message"], param=e.get("param"), code=e.get("code"))
        return HTTPError(503, e["message"], type_="server_error", code=e.get("code"),
                         headers={"Retry-After": str(self.s["retry_after_s"])})

    # -- HTTP entry point -----------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        t0 = time.monotonic()   # arrival: latency metrics and Server-Timing start here
        path, method = request.url.path, request.method
        root = request.scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root):]
        path = path.rstrip("/")
        try:
            if path == "/health" and method == "GET":
                return await self.health()
            if path == "/metrics" and method == "GET":
                return await self.metrics_endpoint()
            api_key = self._check_auth(request)
            if path == "/v1/models" and method == "GET":
                return JSONResponse(await self.models())
            if path.startswith("/v1/models/") and method == "GET":
                return JSONResponse(await self.model(path.removeprefix("/v1/models/")))
            if path == "/v1/completions" and method == "POST":
                return await self._generate(self.completions, request, CompletionRequest, api_key, t0)
            if path == "/v1/chat/completions" and method == "POST":
                return await self._generate(self.chat, request, ChatCompletionRequest, api_key, t0)
            if path == "/v1/responses" and method == "POST":
                return await self._generate(self.responses, request, ResponsesRequest, api_key, t0)
            if path.startswith("/v1/responses/") and self.store is not None:
                return await self.stored_response(path.removeprefix("/v1/responses/"), method,
                                                  request.query_params, api_key)
            if path == "/v1/conversations" or path.startswith("/v1/conversations/"):
                if self.store is None:
                    raise HTTPError(404, "this server keeps no conversations (its response store is off): "
                                         "send the whole conversation with each request", code="not_found")
                return await conversations.handle(self.store, self._owner(api_key),
                                                  path.removeprefix("/v1/conversations"), method,
                                                  request.query_params, partial(self._parsed, request))
            if path.startswith("/v1/chat/completions/") or (path == "/v1/chat/completions" and method == "GET"):
                if self.store is not None:
                    return await stored_chat.handle(self.store, self._owner(api_key),
                                                    path.removeprefix("/v1/chat/completions"), method,
                                                    request.query_params, partial(self._parsed, request))
            if path.startswith(STORED_PATHS) or (path == "/v1/chat/completions" and method == "GET"):
                raise HTTPError(404, "this server stores no responses or chat completions (every request is "
                                     "as with store: false), so none can be retrieved, listed, updated or "
                                     "deleted; send the whole conversation with each request", code="not_found")
            if path == "/tokenize" and method == "POST":
                return JSONResponse(await self.tokenize(await self._body(request, TokenizeRequest)))
            if path == "/detokenize" and method == "POST":
                return JSONResponse(await self.detokenize(await self._body(request, DetokenizeRequest)))
            raise HTTPError(404, f"no route for {method} {request.url.path}", code="not_found")
        except HTTPError as e:
            self.metrics.errors.labels(self.model_name, str(e.status)).inc()
            return e.response()
        except InvalidRequestError as e:
            self.metrics.errors.labels(self.model_name, "400").inc()
            return HTTPError(400, str(e), param=e.param).response()
        except (RayActorError, ActorUnavailableError):
            log.warning("an LLMServer replica died during the request")
            self.metrics.errors.labels(self.model_name, "503").inc()
            return HTTPError(503, "the model replica serving this request failed; retry shortly",
                             type_="server_error", code="replica_failed",
                             headers={"Retry-After": str(self.s["retry_after_s"])}).response()
        except Exception:
            log.exception("request failed")
            self.metrics.errors.labels(self.model_name, "500").inc()
            return HTTPError(500, "internal error; the request was not completed",
                             type_="server_error").response()

    async def _generate(self, endpoint, request: Request, model_cls, api_key: str | None, t0: float) -> Response:
        """A generation route: its body read, then `endpoint`'s response, whose Server-Timing
        gets `read`, the part of `request` spent fetching the body from Serve's proxy (a
        round trip of the replica's own), parsing and validating it; the rest of `request`
        makes the prompt's tokens."""
        body = await self._body(request, model_cls)
        read = time.monotonic() - t0
        response = await endpoint(body, api_key, t0)
        if "Server-Timing" in response.headers:
            response.headers["Server-Timing"] += f", read;dur={read * 1e3:.2f}"
        return response

    async def health(self) -> Response:
        """200 while an engine answers and passes its health check (alive, not stalled),
        else 503, for load balancers in front of the app."""
        try:
            stats = await asyncio.wait_for(self.llm.health(), self.s["health_timeout_s"])
        except Exception:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        self.metrics.replicas.update(stats)
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self) -> Response:
        try:
            self.metrics.replicas.update(await asyncio.wait_for(self.llm.stats(), 5.0))
        except Exception:
            pass  # serve what we have
        if self.store is not None:
            try:
                self.metrics.store.stats = await asyncio.wait_for(self.store.stats(), 5.0)
            except Exception:
                pass
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise HTTPError(404, f"the model {model!r} does not exist; this server serves "
                                 f"{self.model_name!r}", param="model", code="model_not_found")

    async def models(self) -> dict:
        """OpenAI's model list."""
        return {"object": "list", "data": [await self.model(self.model_name)]}

    async def model(self, model: str) -> dict:
        """One model's card (`GET /v1/models/{model}`, the id percent-decoded), with vLLM's
        `root` and `max_model_len` (clients size their context by it); 404 for a model
        this server does not serve. `root` names a hub repo by its id and a local
        directory by its name: where the server keeps its files is not the clients'."""
        self._check_model(model)
        root = self.s["model"]
        if os.path.isabs(root):
            root = os.path.basename(root.rstrip(os.sep))
        return {"id": self.model_name, "object": "model", "created": self.s["created"],
                "owned_by": "mlx-paged-serve", "root": root,
                "max_model_len": (await self.info())["max_model_len"]}

    # -- /tokenize, /detokenize (vLLM's) --------------------------------------------------
    async def tokenize(self, body: TokenizeRequest) -> dict:
        if body.prompt is not None:
            ids = await self._encode(body.prompt, body.add_special_tokens)
        else:
            ids = await self._chat_ids(body.messages, body.add_generation_prompt, body.tools,
                                       body.chat_template_kwargs)
        return {"count": len(ids), "max_model_len": (await self.info())["max_model_len"], "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self._check_vocab(body.tokens, (await self.info())["vocab_size"], "tokens")
        return {"prompt": await self._tokenize(partial(self.tokenizer.decode, body.tokens), 4 * len(body.tokens))}

    # -- /v1/completions ------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, api_key: str | None, t0: float) -> Response:
        prompts = body.prompts()
        if body.stream and len(prompts) > 1:
            raise HTTPError(400, "streaming supports one prompt per request", param="prompt")
        if body.best_of not in (None, body.n):
            raise HTTPError(400, "best_of is not supported", param="best_of")
        # `max_tokens: 0` with `echo` scores the prompt alone (its logprobs): the engine
        # makes one token, which is left out.
        echo_only = body.max_tokens == 0
        jobs = []
        for p in prompts:
            ids = await self._encode(p) if isinstance(p, str) else list(p)
            max_tokens = await self._check_prompt(ids, body.max_tokens)
            params = body.sampling_params(max(max_tokens, 1), body.logprobs)
            if body.echo and body.logprobs is not None:
                params.prompt_logprobs = body.logprobs
            jobs.append((p, ids, params))
        salt = self._salt(body, api_key)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        t_sub = time.monotonic()
        if body.stream:
            p, ids, params = jobs[0]
            first, gen = await self._stream(ids, params, body, salt)
            echo = self._prompt_text(p) if body.echo else None
            return _sse(self._completion_events(rid, created, body, first, gen, echo, t0, ids),
                        server_timing(request=t_sub - t0, first_token=time.monotonic() - t_sub,
                                      **engine_timing(first)))
        started = []
        try:
            for _, ids, params in jobs:
                started.append(await self._stream(ids, params, body, salt))
        except BaseException:
            for _, gen in started:
                gen.cancel()
            raise
        finals = await asyncio.gather(*(self._drain(first, gen, t0) for first, gen in started))
        choices, usage = [], _Usage()
        for j, ((p, ids, _), out) in enumerate(zip(jobs, finals)):
            usage.add(out, completion=not echo_only)
            prefix = self._prompt_text(p) if body.echo else ""
            for o in out.outputs:
                lps = None
                if o.logprobs is not None:
                    lps = self.lp.completion([] if echo_only else o.logprobs, len(prefix))
                    if body.echo:
                        lps = _joined(self.lp.prompt(out.prompt_logprobs, ids, prefix), lps)
                choices.append({"index": j * body.n + o.index, "text": prefix + ("" if echo_only else o.text),
                                "logprobs": lps, "finish_reason": "length" if echo_only else o.finish_reason})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": self.model_name, "choices": choices, "usage": usage.body()},
                            headers=server_timing(request=t_sub - t0, generate=time.monotonic() - t_sub))

    def _completion_events(self, rid, created, body, first, gen, echo, t0: float, prompt_ids: list[int]):
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        prompt_lps = None
        if echo and body.logprobs is not None:
            prompt_lps = self.lp.prompt(first.prompt_logprobs, prompt_ids, echo)
        opening = [{"index": i, "text": echo, "logprobs": prompt_lps, "finish_reason": None}
                   for i in range(body.n)] if echo else []
        offsets = [len(echo or "")] * body.n

        def choice(o):
            lp = self.lp.completion(o.delta_logprobs, offsets[o.index]) \
                if body.logprobs is not None else None
            offsets[o.index] += len(o.delta_text)
            return {"index": o.index, "text": o.delta_text, "logprobs": lp,
                    "finish_reason": o.finish_reason}

        return self._events(first, gen, body, base, opening, choice, t0, len(prompt_ids))

    # -- /v1/chat/completions ---------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, api_key: str | None, t0: float) -> Response:
        try:
            k = body.logprobs_k()
        except ValueError as e:
            raise HTTPError(400, str(e), param="top_logprobs") from None
        ids, parser, t_sub, first, gen = await self._start_chat(body, api_key, k)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        whole = partial(self._chat_completion, rid, created, parser, k is not None)
        keep = partial(self._keep_chat, body, self._owner(api_key)) if body.store and self.store else None
        if body.stream:
            return _sse(self._chat_events(rid, created, body, first, gen, t0, len(ids), parser, whole, keep),
                        server_timing(request=t_sub - t0, first_token=time.monotonic() - t_sub,
                                      **engine_timing(first)))
        completion = whole(await self._drain(first, gen, t0))
        if keep is not None:
            await keep(completion)
        return JSONResponse(completion, headers=server_timing(request=t_sub - t0,
                                                              generate=time.monotonic() - t_sub))

    def _chat_completion(self, rid: str, created: int, parser, logprobs: bool, out) -> dict:
        """The whole `chat.completion` of a request's final output."""
        choices, reasoned = [], {}
        for o in out.outputs:
            message, reason = {"role": "assistant", "content": o.text}, o.finish_reason
            if parser:
                message, reason = parser().message(o.text, o.finish_reason)
            reasoned[o.index] = "reasoning" in message
            choices.append({"index": o.index, "message": message,
                            "logprobs": self.lp.chat(o.logprobs) if logprobs else None,
                            "finish_reason": reason})
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self._chat_usage(out, reasoned)}

    def _chat_usage(self, out, reasoned: dict[int, bool]) -> dict:
        """A chat completion's usage, with OpenAI's `reasoning_tokens`: each choice's
        tokens up to its reasoning's end where it reasoned (`reasoned`, by index)."""
        thought = sum(reasoning_tokens(o.token_ids, self.reasoning_end, reasoned.get(o.index, False))
                      for o in out.outputs)
        return _Usage().add(out, reasoning=thought).body()

    async def _keep_chat(self, body: ChatCompletionRequest, owner: str | None, completion: dict) -> None:
        """Store a chat completion made with `store: true`, with its metadata and the
        messages it answered; a store that fails costs the caller nothing (logged)."""
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        await _quietly(self.store.chat("put", owner, {**completion, "metadata": body.metadata or {}}, messages),
                       f"chat completion {completion['id']}")

    async def _start_chat(self, body: ChatCompletionRequest, api_key: str | None, k: int | None,
                          ids: list[int] | None = None):
        """A chat request's prompt, sent to the engine: its token ids, what makes its
        `ChoiceParser` (or None), when it was sent, and its first output and stream.
        `ids`: the prompt's token ids where they were made already (`_truncated`)."""
        mode = body.tool_mode()
        if mode == "auto" and not (self.tokenizer.has_tool_calling or self.harmony):
            raise HTTPError(400, "this model has no tool-call format that mlx-lm can parse, so tool_choice "
                                 "'auto' (the default with tools) cannot work; use 'required' or name a "
                                 "function, which hold the output to the tools' JSON", param="tool_choice")
        if ids is None:
            ids = await self._chat_ids(body.messages, body.add_generation_prompt, body.tools,
                                       body.template_kwargs(), body.response_format)
        max_tokens = await self._check_prompt(ids, body.max_completion_tokens or body.max_tokens)
        params = body.sampling_params(max_tokens, k)
        if self.harmony:
            params.skip_special_tokens = False   # harmony's framing is special tokens
            if mode in (None, "none") and body.structured_outputs is None and params.structured_outputs is not None:
                params.structured_outputs = answer_constraint(self.harmony, params.structured_outputs)
                await self._validate(params.structured_outputs)
        if mode == "auto":
            params.skip_special_tokens = False   # some families' call markers are special tokens
            fmt = body.response_format if body.response_format and body.response_format.type != "text" else None
            answer = fmt.object_schema() if fmt else None
            if body.structured_outputs is None and (fmt is None or answer is not None):
                if self.harmony:
                    held = harmony_auto(body.callable_defs(), self.harmony, answer, body.restricts_calls())
                else:
                    held = auto_constraint(body.callable_defs(), body.parallel_tool_calls, self.tokenizer, answer,
                                           reasoning_state(self.tokenizer, ids), body.restricts_calls())
                if held:
                    await self._validate(held)
                    params.structured_outputs = held
        parser = self._choice_parser(ids, body, mode)
        t_sub = time.monotonic()
        first, gen = await self._stream(ids, params, body, self._salt(body, api_key))
        return ids, parser, t_sub, first, gen

    async def responses(self, body: ResponsesRequest, api_key: str | None, t0: float) -> Response:
        """The Responses API over the chat pipeline (responses.py). Errors name the
        fields the client sent, not the chat fields they became."""
        try:
            return await self._respond(body, api_key, t0)
        except (HTTPError, InvalidRequestError) as e:
            e.param = _RESPONSES_PARAMS.get(e.param, e.param)
            raise

    def _owner(self, api_key: str | None) -> str | None:
        """Whose stored responses, conversations and chat completions a request may reach:
        its API key's tenant."""
        return tenant_salt(api_key) if api_key is not None else None

    async def _conversation(self, body: ResponsesRequest, owner: str | None) -> tuple[ResponsesRequest, list]:
        """The request with the stored conversation it continues (`previous_response_id`,
        or the items of its `conversation`) before its own input, every item with an id;
        and its own input items."""
        history, own = [], body.input_items()
        if (conv_id := body.conversation_id) is not None:
            if self.store is None:
                raise HTTPError(400, "this server keeps no conversations: send the whole conversation in input",
                                param="conversation")
            history = await self.store.conversation("items", owner, conv_id)
            if history is None:
                raise conversations.missing(conv_id, param="conversation")
        elif body.previous_response_id is not None:
            if self.store is None:
                raise HTTPError(400, "this server stores no responses: send the whole conversation in input "
                                     "(as with store: false)", param="previous_response_id")
            prev = await self.store.get(owner, body.previous_response_id)
            if prev is None:
                raise HTTPError(400, f"Previous response with id '{body.previous_response_id}' not found.",
                                param="previous_response_id", code="previous_response_not_found")
            history = prev.conversation
        return body.with_input(history + own), own

    async def _keep(self, body: ResponsesRequest, owner: str | None, own: list, response: dict) -> None:
        """Store a finished response, if asked, and add its input (`own`) and output items
        to its conversation once it ended well; a store that fails costs the caller
        nothing but the chain (logged)."""
        if (conv_id := body.conversation_id) is not None and response["status"] in ("completed", "incomplete"):
            await _quietly(_appended(self.store.conversation("append", owner, conv_id, own + response["output"])),
                           f"the turn of conversation {conv_id}")
        if self.store is not None and body.stored:
            await _quietly(self.store.put(owner, response, body.input_items()), f"response {response['id']}")

    async def stored_response(self, rest: str, method: str, query, api_key: str | None) -> Response:
        """`GET` and `DELETE /v1/responses/{id}`, `GET .../input_items` (paged as OpenAI's
        list: `limit`, `order`, `after`), and `POST .../cancel` of a background response
        still running (`_run_background`)."""
        rid, _, sub = rest.partition("/")
        owner = self._owner(api_key)
        record = await self.store.get(owner, rid)
        if record is None:
            raise HTTPError(404, f"Response with id '{rid}' not found.", code="not_found")
        if (method, sub) == ("GET", ""):
            if query.get("stream", "false").lower() != "false":
                raise HTTPError(400, "a stored response is read back whole: stream is not supported here",
                                param="stream")
            return JSONResponse(record.response)
        if (method, sub) == ("DELETE", ""):
            await self.store.delete(owner, rid)
            return JSONResponse({"id": rid, "object": "response", "deleted": True})
        if (method, sub) == ("GET", "input_items"):
            return JSONResponse(items_page(record.input_items, query))
        if (method, sub) == ("POST", "cancel"):
            cancelled, response = await self.store.cancel(owner, rid)
            if not cancelled:
                raise HTTPError(400, f"only a background response still running can be cancelled; this one is "
                                     f"{response['status']}", code="not_cancellable")
            task = self._background.get(rid)
            if task is not None:     # running here; on another replica its watcher sees the mark
                task.cancel()
            return JSONResponse(response)
        raise HTTPError(404, f"no route for {method} /v1/responses/{rest}", code="not_found")

    def _chat_of(self, body: ResponsesRequest) -> ChatCompletionRequest:
        try:
            return ChatCompletionRequest.model_validate(body.chat_body())
        except ValidationError as e:
            raise _validation_error(e, _RESPONSES_PARAMS, ChatCompletionRequest.model_fields) from None

    async def _fitting_ids(self, body: ResponsesRequest) -> list[int] | None:
        """The request's prompt token ids if the prompt and its output fit the model's
        context, else None."""
        chat = self._chat_of(body)
        ids = await self._chat_ids(chat.messages, chat.add_generation_prompt, chat.tools, chat.template_kwargs(),
                                   chat.response_format)
        try:
            await self._check_prompt(ids, chat.max_completion_tokens)
        except HTTPError as e:
            if e.code == "context_length_exceeded":
                return None
            raise
        return ids

    async def _truncated(self, body: ResponsesRequest) -> tuple[ResponsesRequest, list[int] | None]:
        """`truncation: "auto"`: the conversation from the earliest turn on which it fits
        (OpenAI drops items from its beginning), and its prompt's token ids; unchanged
        when it fits whole, and without ids when not even its last turn fits (then the
        usual 400 says why)."""
        if (ids := await self._fitting_ids(body)) is not None:
            return body, ids
        starts = body.turn_starts()[1:]
        lo, hi = 0, len(starts)      # cuts before `lo` do not fit; the one at `hi` does (if any)
        while lo < hi:
            mid = (lo + hi) // 2
            if (fit := await self._fitting_ids(body.model_copy(update={"input": body.input[starts[mid]:]}))) is None:
                lo = mid + 1
            else:
                hi, ids = mid, fit
        if lo == len(starts):
            return body, None
        return body.model_copy(update={"input": body.input[starts[lo]:]}), ids

    async def _respond(self, body: ResponsesRequest, api_key: str | None, t0: float) -> Response:
        owner = self._owner(api_key)
        (body, own), ids = await self._conversation(body, owner), None
        if body.truncation == "auto":
            body, ids = await self._truncated(body)
        if body.background and (self.store is None or not body.stored):
            raise HTTPError(400, "this server stores no responses, so none can run in the background",
                            param="background")
        chat = self._chat_of(body)
        await self._check_constraint(chat)
        markers = self._text_logprobs_markers(body)
        ids, parser, t_sub, first, gen = await self._start_chat(chat, api_key, chat.logprobs_k(), ids)
        parser = parser or ChoiceParser
        envelope = ResponseBody(body, self.model_name, stored=self.store is not None and body.stored)
        # Where the reasoning ends, for its usage; a harmony turn's: its first message's end.
        text_lps = None
        if body.wants_logprobs:
            mode = chat.tool_mode()
            text_lps = HarmonyTextLogprobs(self.harmony, mode == "auto") if self._reads_harmony(mode) else \
                TextLogprobs(markers, reasoning_state(self.tokenizer, ids))
        keep = partial(self._keep, body, owner, own)
        if body.stream:
            return _sse(self._response_events(envelope, parser(), first, gen, t0, text_lps, keep),
                        server_timing(request=t_sub - t0, first_token=time.monotonic() - t_sub,
                                      **engine_timing(first)), named=True)
        whole = partial(self._whole_response, envelope, parser, first, gen, t0, text_lps)
        if body.background:
            running = envelope.body("in_progress", [])
            await keep(running)
            task = asyncio.create_task(self._run_background(envelope, owner, keep, whole))
            self._background[envelope.id] = task
            task.add_done_callback(lambda _: self._background.pop(envelope.id, None))
            return JSONResponse(running)
        response = await whole()
        await keep(response)
        return JSONResponse(response, headers=server_timing(request=t_sub - t0, generate=time.monotonic() - t_sub))

    async def _whole_response(self, envelope, parser, first, gen, t0: float, text_lps: TextLogprobs | None) -> dict:
        out = await self._drain(first, gen, t0)
        o = out.outputs[0]
        parts, _ = parser().parts(o.text, o.finish_reason)
        if text_lps is not None:
            text_lps.add(self.lp.with_bytes(o.token_ids, o.logprobs))
        usage = self._response_usage(out, any(kind == "reasoning" for kind, _ in parts))
        return whole_response(envelope, parts, o.finish_reason, usage, text_lps)

    async def _run_background(self, envelope, owner: str | None, keep, whole) -> None:
        """A background response, run to its end beside the requests that poll it: stored
        when done (or as failed). Cancelled (`POST .../cancel`, here or through the store
        from another replica, or the response deleted), it stops, which aborts its engine
        request: `_chain` cancels the replica's stream."""
        watcher = asyncio.create_task(self._watch_cancel(owner, envelope.id, asyncio.current_task()))
        try:
            await keep(await whole())
        except asyncio.CancelledError:
            pass
        except Exception as e:
            log.exception("background response %s failed", envelope.id)
            said = str(e) if isinstance(e, (HTTPError, InvalidRequestError)) else "internal error"
            await keep(envelope.body("failed", [], error={"code": "server_error", "message": said}))
        finally:
            watcher.cancel()

    async def _watch_cancel(self, owner: str | None, rid: str, task: asyncio.Task) -> None:
        """Renew the stored response's lease while `task` runs it (`ResponseStore.renew`);
        cancel `task` once the response no longer reads running (cancelled, or failed when
        its lease lapsed) or is gone."""
        while True:
            await asyncio.sleep(BACKGROUND_POLL_S)
            try:
                record = await self.store.renew(owner, rid)
            except Exception:   # the store is being replaced: ask again next time
                continue
            if record is None or record.response["status"] not in RUNNING:
                task.cancel()
                return

    def _text_logprobs_markers(self, body: ResponsesRequest) -> tuple[int, int] | None:
        """The model's think marker ids (`think_markers`). A 400 where output_text logprobs
        are asked of a thinking model whose markers span several tokens: its answer's
        tokens cannot be told from its reasoning's."""
        markers = think_markers(self.tokenizer)
        if body.wants_logprobs and not self.harmony and self.tokenizer.has_thinking and markers is None:
            raise HTTPError(400, "this model's think markers are not single tokens, so its answer's tokens "
                                 "cannot be told from its reasoning's: output_text logprobs are not available",
                            param="include")
        return markers

    def _response_usage(self, out, reasoned: bool) -> dict:
        u = _Usage().add(out)
        thought = reasoning_tokens(out.outputs[0].token_ids, self.reasoning_end, reasoned)
        return response_usage(u.prompt, u.completion, u.cached, thought)

    async def _response_events(self, envelope, parser, first, gen, t0: float, text_lps: TextLogprobs | None,
                               keep):
        """The stream's events; `keep` stores the finished response before its last event
        goes out, so a client may continue it as soon as it has that event."""
        timer, stream = RequestTimer(self.metrics, t0), ResponseEvents(envelope, text_lps)
        for ev in stream.opening():
            yield ev
        last = None
        async for out in self._chain(first, gen):
            last = out
            timer.output(out)
            o = out.outputs[0]
            if text_lps is not None:
                text_lps.add(self.lp.with_bytes(o.delta_token_ids, o.delta_logprobs))
            if o.delta_text or o.finish_reason:
                for ev in stream.feed(parser.parts(o.delta_text, o.finish_reason)[0]):
                    yield ev
        self._finish(timer, last)
        usage = self._response_usage(last, stream.reasoned)
        closing = stream.closing(last.outputs[0].finish_reason, usage)
        await keep(closing[-1]["response"])
        for ev in closing:
            yield ev

    def _reads_harmony(self, mode: str | None) -> bool:
        """Whether a choice is read as harmony: a harmony model's, unless a forced tool
        choice holds its text to the calls' JSON."""
        return self.harmony is not None and mode in (None, "auto", "none")

    def _choice_parser(self, ids: list[int], body, mode: str | None):
        """What makes a `ChoiceParser` per choice, where reasoning or tool calls are split
        out of the text; None where the text is the content as it is. A harmony model's
        text is read by its own parser, except where a forced choice holds it to calls."""
        if self._reads_harmony(mode):
            return partial(HarmonyParser, mode == "auto")
        split = None
        if self.tokenizer.has_thinking:
            split = partial(ReasoningSplit, self.tokenizer.think_start, self.tokenizer.think_end,
                            reasoning_state(self.tokenizer, ids) == "thinking")
        tools = partial(ToolOutput, mode, self.tokenizer, body.tool_defs()) if mode else None
        if split is None and tools is None:
            return None
        return lambda: ChoiceParser(split() if split else None, tools() if tools else None)

    def _chat_events(self, rid, created, body, first, gen, t0: float, num_prompt: int, parser=None,
                     whole=None, keep=None):
        """`parser`: makes a `ChoiceParser` per choice (`_choice_parser`); `keep`: stores
        the whole completion (`whole` makes it of the final output) before the stream ends."""
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(body.n)]
        parsers = [parser() for _ in range(body.n)] if parser else None
        reasoned = {}

        def choice(o):
            delta, reason = {"content": o.delta_text} if o.delta_text or o.delta_token_ids else {}, o.finish_reason
            if parsers:
                delta, reason = parsers[o.index].feed(o.delta_text, reason)
                reasoned[o.index] = reasoned.get(o.index, False) or "reasoning" in delta
            return {"index": o.index, "delta": delta,
                    "logprobs": self.lp.chat(o.delta_logprobs) if body.logprobs else None,
                    "finish_reason": reason}

        on_last = None if keep is None else (lambda last: keep(whole(last)))
        return self._events(first, gen, body, base, opening, choice, t0, num_prompt, on_last,
                            lambda last: self._chat_usage(last, reasoned))

    async def _events(self, first, gen, body, base: dict, opening: list[dict], choice, t0: float,
                      num_prompt: int, on_last=None, usage=None):
        """The SSE chunks of either endpoint: the `opening` choices, then one chunk per
        completion with something new (`choice` shapes it), then usage if asked for,
        and with `continuous_usage_stats` the usage so far in every chunk. `t0`: when
        the request arrived, where its latency metrics start. `on_last` (a coroutine
        function) gets the final output before the usage chunk."""
        timer = RequestTimer(self.metrics, t0)
        opts = body.stream_options
        usage_each = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        made = 0   # completion tokens streamed so far, all choices together

        def chunk(choices: list[dict], out) -> dict:
            ev = {**base, "choices": choices}
            if usage_each:
                ev["usage"] = usage_body(num_prompt, made, out.num_cached_tokens)
            return ev

        for c in opening:
            yield chunk([c], first)
        last = None
        async for out in self._chain(first, gen):
            last = out
            timer.output(out)
            made += sum(len(o.delta_token_ids) for o in out.outputs)
            for o in out.outputs:
                if o.delta_text or o.delta_token_ids or o.finish_reason:
                    yield chunk([choice(o)], out)
        self._finish(timer, last)
        if on_last is not None and last is not None:
            await on_last(last)
        if opts and opts.include_usage:
            yield {**base, "choices": [], "usage": usage(last) if usage else _Usage().add(last).body()}

    async def _drain(self, first, gen, t0: float):
        """Collect a non-streamed request; returns its final output."""
        timer, last = RequestTimer(self.metrics, t0), None
        async for out in self._chain(first, gen):
            timer.output(out)
            last = out
        self._finish(timer, last)
        return last

    # -- helpers -----------------------------------------------------------------------
    async def _chain(self, first, gen):
        """The first item, then the rest; an error item raises its HTTP error. Leaving
        early (the client went away) cancels the replica's stream, which aborts the
        engine request and frees its blocks."""
        done = False
        try:
            yield first
            if not getattr(first, "finished", False):
                async for item in gen:
                    if isinstance(item, dict) and "error" in item:
                        raise self._item_error(item["error"])
                    yield item
            done = True
        finally:
            if not done:
                gen.cancel()

    def _finish(self, timer: RequestTimer, out) -> None:
        if out is None:
            return
        self.metrics.replicas.update(getattr(out, "engine_stats", None))
        timer.done(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs),
                   [o.finish_reason for o in out.outputs])

    def _prompt_text(self, p) -> str:
        return p if isinstance(p, str) else self.tokenizer.decode(p)


def _joined(a: dict, b: dict) -> dict:
    """Two parts of completions logprobs, one after the other."""
    return {k: a[k] + b[k] for k in a}


class _Usage:
    def __init__(self):
        self.prompt = self.completion = self.cached = 0
        self.reasoning: int | None = None

    def add(self, out, completion: bool = True, reasoning: int | None = None):
        """`completion` False: the tokens made are not handed out (an echo-only request);
        `reasoning`: the reasoning tokens among them (chat's), else left out."""
        if out is not None:
            self.prompt += len(out.prompt_token_ids)
            self.completion += sum(len(o.token_ids) for o in out.outputs) if completion else 0
            self.cached += out.num_cached_tokens
        if reasoning is not None:
            self.reasoning = (self.reasoning or 0) + reasoning
        return self

    def body(self) -> dict:
        return usage_body(self.prompt, self.completion, self.cached, self.reasoning)


def usage_body(prompt: int, completion: int, cached: int, reasoning: int | None = None) -> dict:
    body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return body


def engine_timing(out) -> dict[str, float]:
    """The parts of `first_token` the engine side timed, for `server_timing`
    (`RequestMetrics.ttft_parts`): `to_engine` (sent until the engine loop took it),
    `engine_queue` (waiting to be scheduled), `engine_prefill` (scheduled to first
    token), `from_engine` (back beside the replica's engine client) and `to_caller`
    (until the handler had it). Empty for an output without them; with the deployments
    apart, the hop to the `LLMServer` replica and back is what `first_token` holds
    beyond them."""
    m = getattr(out, "metrics", None)
    return m.ttft_parts() if m is not None else {}


async def _appended(call) -> list | None:
    """A conversation store `append`'s items added: None where it refused them (too
    large) or the conversation is gone."""
    return (await call)[1]


async def _quietly(call, what: str) -> None:
    """Await a store call that costs its caller nothing if it fails but what it keeps:
    a refusal (too large for `response_store.max_bytes`, or its conversation gone) and
    an error are logged."""
    try:
        if not await call:
            log.warning("%s not stored: refused (larger than response_store.max_bytes, or gone)", what)
    except Exception:
        log.exception("could not store %s", what)


def server_timing(**seconds: float) -> dict[str, str]:
    """A `Server-Timing` header (W3C), durations in ms, from the request's arrival in this
    replica: `request` (its body read from Serve's proxy, validated, tokenized; the
    generation routes add `read`, its first part),
    `first_token` (a stream: until the first token is in hand, the engine's queue and
    prefill, and with the deployments apart the hop to the `LLMServer` replica and back;
    the headers leave with it) or `generate` (a whole response), and for a stream, the
    parts of `first_token` that `engine_timing` names.
    What a client measures beyond `request` and `first_token` is the way in and out
    through Serve's proxy."""
    return {"Server-Timing": ", ".join(f"{k};dur={v * 1e3:.2f}" for k, v in seconds.items())}


def _sse(events, headers: dict[str, str], named: bool = False) -> StreamingResponse:
    """`named`: the Responses API's stream, each event under its `type` (`event:` lines),
    an error as an `error` event, and no `[DONE]`."""
    async def body():
        try:
            async for ev in events:
                yield f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n" if named else f"data: {json.dumps(ev)}\n\n"
            if not named:
                yield "data: [DONE]\n\n"
        except Exception as e:
            log.exception("stream failed")
            err = error_body("the stream was interrupted by a server error", "server_error")
            if isinstance(e, HTTPError):
                err = error_body(str(e), e.type, e.param, e.code)
            if named:
                yield f"event: error\ndata: {json.dumps({'type': 'error', **err['error']})}\n\n"
            else:
                yield f"data: {json.dumps(err)}\n\n"
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
