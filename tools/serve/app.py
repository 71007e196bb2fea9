"""The FastAPI application: OpenAI's routes over the AsyncEngine, plus /health, /metrics and the chat page at /.

Every refusal is an APIError rendered as OpenAI's error body with its status; a request the server never
expected (a bug) is a 500 with the same body shape, and the server stays up. With an API key, every /v1 route
needs `Authorization: Bearer KEY`, compared in constant time.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from tools.serve.async_engine import AsyncEngine, RequestRefused
from tools.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse
from tools.serve.requests import (ServedModel, adapter_for, chat_prompt, completion_prompts, sampling_params)
from tools.text_stream import TextStream

MAX_BODY_BYTES = 32 * 2 ** 20


def build_app(engine: AsyncEngine, model: ServedModel, make_params, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES):
    app = FastAPI(title="llama32", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception):  # a bug: the request fails (500), the server stays up
        return error(APIError(f"internal error: {type(e).__name__}", status=500, type="server_error"))

    async def body_of(request: Request):
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > max_body_bytes:
                raise APIError(f"the request body is over {max_body_bytes} bytes", status=413)
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError("the request body is not valid JSON") from None

    @app.get("/health")
    async def health():
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(engine.stats), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def page():
        return HTMLResponse(resources.files("tools.serve").joinpath("chat.html").read_text(encoding="utf-8"))

    @app.get("/v1/models")
    async def models():
        def card(name: str, parent: str | None) -> dict:
            return {"id": name, "object": "model", "created": created, "owned_by": "llama32", "root": name,
                    "parent": parent, "vision": model.vision}
        return {"object": "list", "data": [card(model.name, None)] + [card(a, model.name) for a in model.adapters]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            req = parse(ChatCompletionRequest, await body_of(request))
            adapter = adapter_for(model, req.model)
            ids, images = chat_prompt(model, req)
            top = (req.top_logprobs or 0) if req.logprobs else None
            params = sampling_params(model, req, make_params, len(ids), req.limit(), top)
        except APIError as e:
            return error(e)
        return await respond(request, req, "chat", [(ids, params)], adapter, images)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            req = parse(CompletionRequest, await body_of(request))
            adapter = adapter_for(model, req.model)
            jobs = [(ids, sampling_params(model, req, make_params, len(ids), req.max_tokens, req.logprobs))
                    for ids in completion_prompts(model, req)]
        except APIError as e:
            return error(e)
        return await respond(request, req, "text", jobs, adapter)

    async def respond(request, req, kind: str, jobs, adapter, images=None):
        rid = engine.new_id("chatcmpl" if kind == "chat" else "cmpl")
        flat = [(ids, p) for ids, params in jobs for p in params]
        choices = [Choice(i, ids, p, req.stop, model, kind, images) for i, (ids, p) in enumerate(flat)]
        arrived = time.perf_counter()
        prompt_tokens = sum(len(ids) for ids, _ in jobs)
        head = {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": req.model}
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(stream_sse(rid, head, choices, adapter, prompt_tokens, include_usage, kind,
                                                arrived), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        task = asyncio.ensure_future(asyncio.gather(*(c.run(engine, f"{rid}-{c.index}", adapter) for c in choices)))
        if not await finished_or_disconnected(request, task):
            engine.metrics.finished("abort", prompt_tokens, choices, arrived)
            return error(APIError("the client disconnected", status=499))
        try:
            task.result()
        except RequestRefused as e:
            engine.metrics.finished("error", prompt_tokens, choices, arrived)
            return error(APIError(str(e)))
        except RuntimeError as e:
            engine.metrics.finished("error", prompt_tokens, choices, arrived)
            return error(APIError(str(e), status=500, type="server_error"))
        engine.metrics.finished(None, prompt_tokens, choices, arrived)
        completion_tokens = sum(c.tokens for c in choices)
        return {**head, "choices": [c.final(kind) for c in choices],
                "usage": usage(prompt_tokens, completion_tokens)}

    async def stream_sse(rid, head, choices, adapter, prompt_tokens, include_usage, kind, arrived):
        chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        events: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(c.run(engine, f"{rid}-{c.index}", adapter, events)) for c in choices]
        done, outcome = 0, "abort"
        try:
            if kind == "chat":
                for c in choices:
                    yield sse({**head, "object": chunk_object, "choices": [
                        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}], **({"usage": None} if include_usage else {})})
            while done < len(choices):
                c, delta, logprobs, finished = await events.get()
                if isinstance(delta, Exception):
                    outcome = "error"
                    refused = isinstance(delta, RequestRefused)
                    yield sse(APIError(str(delta), status=400 if refused else 500,
                                       type="invalid_request_error" if refused else "server_error").body())
                    break
                if delta or logprobs or finished:
                    choice = c.chunk(kind, delta, logprobs, finished)
                    yield sse({**head, "object": chunk_object, "choices": [choice],
                               **({"usage": None} if include_usage else {})})
                done += finished
            else:
                if include_usage:
                    yield sse({**head, "object": chunk_object, "choices": [],
                               "usage": usage(prompt_tokens, sum(c.tokens for c in choices))})
                outcome = None
                yield "data: [DONE]\n\n"
        finally:  # the client went away (the response is cancelled) or the stream ended: nothing keeps running
            for t in tasks:
                t.cancel()
            engine.metrics.finished(outcome, prompt_tokens, choices, arrived)

    return app


class Guard:
    """ASGI middleware before every route: the API key on /v1 routes (constant-time comparison) and the body's
    declared size. Plain ASGI, so a client's disconnect still reaches the routes."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            refusal = None
            if self.expected is not None and scope["path"].startswith("/v1/") and not hmac.compare_digest(
                    headers.get(b"authorization", b""), self.expected):
                refusal = APIError("Incorrect API key provided", status=401, type="authentication_error",
                                   code="invalid_api_key")
            length = headers.get(b"content-length")
            if refusal is None and length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                refusal = APIError(f"the request body is over {self.max_body_bytes} bytes", status=413)
            if refusal is not None:
                return await JSONResponse(refusal.body(), status_code=refusal.status)(scope, receive, send)
        await self.app(scope, receive, send)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def finished_or_disconnected(request, task, poll: float = 0.25) -> bool:
    """Wait for `task`; if the client disconnects first, cancel it (aborting its requests) and say so."""
    while not task.done():
        await asyncio.wait([task], timeout=poll)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            return False
    return True


class Choice:
    """One choice of a response: runs its engine request and holds its text, tokens and logprobs."""

    def __init__(self, index: int, prompt_ids, params, stops, model: ServedModel, kind: str, images=None):
        """images: a vision model's ImageInputs for the prompt (None: none)."""
        self.index, self.prompt_ids, self.params, self.kind = index, prompt_ids, params, kind
        self.images = images
        self.text = TextStream(model.tokenizer, stops, model.stop_ids)
        self.tok = model.tokenizer
        self.want_logprobs = getattr(params, "logprobs", None) is not None
        self.tokens = 0
        self.finish_reason: str | None = None
        self.logprobs: list = []

    async def run(self, engine: AsyncEngine, rid: str, adapter, events: asyncio.Queue | None = None) -> None:
        try:
            async for out in engine.generate(rid, self.prompt_ids, self.params, adapter, self.images):
                delta = self.text.push(out.new_token_ids)
                new_logprobs = list(out.logprobs or [])[-len(out.new_token_ids):] if self.want_logprobs else []
                if self.text.stopped:
                    self.tokens = self.text.tokens_at_stop
                    keep = len(new_logprobs) - (len(self.text.ids) - self.tokens)
                    self.logprobs += new_logprobs[:max(keep, 0)]
                    self.finish_reason = "stop"
                    if events is not None:
                        events.put_nowait((self, delta, new_logprobs[:max(keep, 0)], True))
                    return  # leaving the generator aborts the engine request
                self.tokens = len(out.token_ids)
                self.logprobs += new_logprobs
                if out.finished:
                    delta += self.text.finish()
                    self.finish_reason = "length" if out.finish_reason == "length" else "stop"
                if events is not None:
                    events.put_nowait((self, delta, new_logprobs, out.finished))
                if out.finished:
                    return
        except RuntimeError as e:
            if events is None:
                raise
            events.put_nowait((self, e, None, True))

    def _logprobs(self, kind: str, entries) -> dict | None:
        if not self.want_logprobs:
            return None
        if kind == "chat":
            def item(tid, lp):
                text = self.tok.decode([tid])
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**item(e[0], e[1]), "top_logprobs": [item(t, lp) for t, lp in e[2]]}
                                for e in entries]}
        return {"tokens": [self.tok.decode([e[0]]) for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [{self.tok.decode([t]): lp for t, lp in e[2]} for e in entries]}

    def chunk(self, kind: str, delta: str, logprobs, finished: bool) -> dict:
        reason = self.finish_reason if finished else None
        lp = self._logprobs(kind, logprobs) if logprobs else None
        if kind == "chat":
            return {"index": self.index, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                    "finish_reason": reason}
        return {"index": self.index, "text": delta, "logprobs": lp, "finish_reason": reason}

    def final(self, kind: str) -> dict:
        lp = self._logprobs(kind, self.logprobs)
        if kind == "chat":
            return {"index": self.index, "message": {"role": "assistant", "content": self.text.text},
                    "logprobs": lp, "finish_reason": self.finish_reason}
        return {"index": self.index, "text": self.text.text, "logprobs": lp, "finish_reason": self.finish_reason}
