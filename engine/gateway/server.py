"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of a ``Gateway``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming with one
chunk per output token, or one JSON body), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text: the gateway's metrics plus every replica's), and vLLM's
``POST /tokenize`` / ``POST /detokenize`` (same bodies and answers as vLLM's server).

Request path: parse and validate (400/404 before any queueing), tokenize, then
``Gateway.submit`` (admission may wait or refuse with 429), then stream the deltas.
A client that goes away (while queued, while generating, mid-stream) has its request
aborted in the engine, which frees its KV blocks at once.

``ServerThread`` runs the server on a background thread (``layerscope run``, tests);
``serve`` runs it in the foreground (``layerscope serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from layerscope.engine.gateway.gateway import Gateway
from layerscope.engine.gateway.records import GatewayRecord, RequestStream
from layerscope.engine.warmup import freeze_startup_heap
from layerscope.engine.gateway.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponseBuilder,
    TokenizeRequest,
    parse_body,
    render_chat,
    usage_dict,
)

CLIENT_GONE = 499  # nginx's "client closed request": recorded, never sent


def error_response(err: APIError, request_id: str | None = None) -> JSONResponse:
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-Id"] = request_id  # joins a refused request with the client's record
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _until_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body must have been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class _Api:
    """What the routes share: the gateway, the API key and the model names a request may name."""

    def __init__(self, gateway: Gateway, api_key: str | None) -> None:
        self.gateway, self.api_key = gateway, api_key
        self.names = {gateway.model_name}
        if gateway.model_name == gateway.config.model:
            self.names.add(Path(gateway.config.model).name)  # the directory's name also works

    def check_key(self, request: Request) -> None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.gateway.model_name}`.",
                           type="not_found_error", param="model", code="model_not_found")

    async def parsed(self, request: Request, model: type):
        """The key checked, the body parsed as ``model`` and its model name checked (APIError)."""
        self.check_key(request)
        req = parse_body(await request.body(), model)
        self.check_model(req.model)
        return req

    async def tokenize(self, request: Request) -> Response:
        gateway = self.gateway
        try:
            req = await self.parsed(request, TokenizeRequest)
            if (req.prompt is None) == (req.messages is None):
                raise APIError(400, "send exactly one of `prompt` or `messages`", param="prompt")
            chat = req.chat()
            text = render_chat(gateway.tokenizer, chat) if chat is not None else req.prompt
            ids = gateway.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        except APIError as e:
            return error_response(e)
        return JSONResponse({"count": len(ids), "max_model_len": gateway.max_model_len, "tokens": ids,
                             "token_strs": None})

    async def generate(self, request: Request, chat: bool) -> Response:
        """A completion or chat completion: checked, admitted, then streamed (SSE) or answered whole."""
        gateway = self.gateway
        rec = gateway.new_record("chat" if chat else "completions", False, request.headers.get("x-session-id"),
                                 traceparent=request.headers.get("traceparent"))
        try:
            self.check_key(request)
            req = parse_body(await request.body(), ChatCompletionRequest if chat else CompletionRequest)
            rec.stream = req.stream
            rec.session_id = rec.session_id or req.user
            self.check_model(req.model)
            if chat:
                ids = gateway.tokenize(render_chat(gateway.tokenizer, req))
                max_tokens = req.requested_max_tokens
            else:
                ids = gateway.tokenize(req.single_prompt())
                max_tokens = req.max_tokens
            params = req.sampling_params(gateway.check_length(len(ids), max_tokens))
        except APIError as e:
            gateway.reject(rec, e)
            return error_response(e, rec.request_id)
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            stream = await _unless_gone(gateway.submit(rec, ids, params), gone, gateway)
        except APIError as e:
            gone.cancel()
            gateway.reject(rec, e)
            return error_response(e, rec.request_id) if e.status != CLIENT_GONE else Response(status_code=CLIENT_GONE)
        builder = ResponseBuilder(rec.request_id, gateway.model_name, chat, params.logprobs)
        if req.stream:
            gone.cancel()  # from here StreamingResponse watches the connection itself
            text = _StopHoldback(max((len(x) for x in params.stop), default=0))
            return StreamingResponse(_sse(gateway, stream, builder, req.include_usage, text),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rec.request_id})
        gone.add_done_callback(lambda t: t.cancelled() or stream.closed or
                               stream.queue.put_nowait(APIError(CLIENT_GONE, "client disconnected")))
        try:
            return await _full(gateway, stream, builder)
        finally:
            gone.cancel()


def create_app(gateway: Gateway, api_key: str | None = None,
               metrics_extra: Callable[[Gateway, bytes], bytes] | None = None) -> FastAPI:
    """``metrics_extra(gateway, exposition)``: more exposition text appended to /metrics (e.g. the
    registry under vLLM's names, which ``layerscope serve --metrics-dialect vllm`` hands in)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        gateway.attach(asyncio.get_running_loop())
        yield

    app = FastAPI(title="layerscope", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    api = _Api(gateway, api_key)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       type=kind))

    @app.get("/health")
    async def health() -> Response:
        if gateway.is_healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        text = gateway.metrics_text()
        if metrics_extra is not None:
            text += metrics_extra(gateway, text)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            api.check_key(request)
        except APIError as e:
            return error_response(e)
        card = {"id": gateway.model_name, "object": "model", "created": int(time.time()), "owned_by": "layerscope",
                "root": gateway.config.model, "max_model_len": gateway.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await api.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            req = await api.parsed(request, DetokenizeRequest)
            ids = gateway.tokenize(req.tokens)  # ids outside the vocabulary are a 400 naming it
        except APIError as e:
            return error_response(e)
        return JSONResponse({"prompt": gateway.tokenizer.decode(ids)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await api.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await api.generate(request, chat=True)

    return app


async def _unless_gone(coro: Awaitable[RequestStream], gone: asyncio.Future, gateway: Gateway) -> RequestStream:
    """Await ``coro`` (admission + hand-off) unless the client disconnects first."""
    task = asyncio.ensure_future(coro)
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    try:
        stream = await task
    except (asyncio.CancelledError, APIError):
        pass
    else:  # admitted in the same instant: undo it
        gateway.close(stream, CLIENT_GONE, "client disconnected")
    raise APIError(CLIENT_GONE, "client disconnected while queued")


def _usage(rec: GatewayRecord) -> dict[str, Any]:
    return usage_dict(rec.num_prompt_tokens or 0, rec.num_output_tokens, rec.num_cached_tokens or 0)


class _StopHoldback:
    """Streams text so that no character of a stop string is ever sent.

    The engine finds a stop string only once it is complete, by which time its first
    characters may have gone out with earlier tokens; so, while stop strings are set,
    the last ``longest - 1`` characters are held back until the next token (vLLM does
    the same). The finished delta carries the final text, already cut at the stop.
    """

    def __init__(self, longest_stop: int):
        self.hold = max(longest_stop - 1, 0)
        self.text = ""
        self.num_sent = 0

    def push(self, d) -> str:
        if d.finished and d.text is not None:
            out = d.text[self.num_sent:]
            self.num_sent = len(d.text)
            return out
        self.text += d.new_text
        if not self.hold:
            out = self.text[self.num_sent:]
        else:
            out = self.text[self.num_sent: max(self.num_sent, len(self.text) - self.hold)]
        self.num_sent += len(out)
        return out


async def _sse(gateway: Gateway, stream: RequestStream, builder: ResponseBuilder, include_usage: bool,
               text: _StopHoldback) -> AsyncIterator[str]:
    status, error = CLIENT_GONE, "client disconnected"  # unless we get to the end
    try:
        if builder.chat:
            yield builder.role_chunk()
        async for d in stream.deltas():  # one chunk per token, even when its text is held back or empty
            yield builder.token_chunk(text.push(d), d.finish_reason if d.finished else None, d.stop_reason,
                                      d.logprobs)
        if include_usage:
            yield builder.usage_chunk(_usage(stream.record))
        status, error = 200, None
        yield builder.DONE
    except APIError as e:  # a failure after the response started: an error event, as vLLM sends
        status, error = e.status, e.message
        if e.status != CLIENT_GONE:
            yield builder.error_event(e)
            yield builder.DONE
    finally:
        gateway.close(stream, status, error)


async def _full(gateway: Gateway, stream: RequestStream, builder: ResponseBuilder) -> Response:
    last, logprobs = None, []
    try:
        async for d in stream.deltas():
            last = d
            logprobs += d.logprobs or ()
    except APIError as e:
        gateway.close(stream, e.status, e.message)
        return error_response(e, stream.record.request_id) if e.status != CLIENT_GONE else Response(status_code=CLIENT_GONE)
    except BaseException:
        gateway.close(stream, 500, "internal error")
        raise
    body = builder.full(last.text or "", last.finish_reason, last.stop_reason, _usage(stream.record), logprobs)
    gateway.close(stream, 200)
    return JSONResponse(body, headers={"X-Request-Id": stream.record.request_id})


# ---- running it ---------------------------------------------------------------------------------
class _Server(uvicorn.Server):
    """uvicorn, minus re-raising the captured signal after shutdown (our caller cleans up)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _uvicorn_config(app: FastAPI, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                          timeout_graceful_shutdown=5, timeout_keep_alive=30)


def _bound_port(server: uvicorn.Server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]


class ServerThread:
    """The HTTP server on a background thread with its own event loop."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None):
        self.server = _Server(_uvicorn_config(create_app(gateway, api_key), host, port))
        self.host = host
        self.port = 0
        self._thread = threading.Thread(target=self.server.run, name="layerscope-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        self.port = _bound_port(self.server)
        return self.url

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)


@contextlib.contextmanager
def serving(gateway: Gateway, startup_timeout_s: float = 300.0):
    """Start ``gateway``'s replicas and an in-process HTTP server on 127.0.0.1; yield its
    URL; stop the server and shut the gateway down on the way out (also on errors). While it
    serves, this process's heap as it was at startup is frozen (``freeze_startup_heap``; unfrozen
    on the way out: the process goes on)."""
    server = None
    frozen = False
    try:
        gateway.start(timeout_s=startup_timeout_s)
        server = ServerThread(gateway)
        url = server.start()
        freeze_startup_heap()
        frozen = True
        yield url
    finally:
        if frozen:
            gc.unfreeze()
        if server is not None:
            server.stop()
        gateway.shutdown()


def serve(gateway: Gateway, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
          announce=print, metrics_extra: Callable[[Gateway, bytes], bytes] | None = None) -> None:
    """Serve in the foreground until SIGINT/SIGTERM; ``announce`` gets the listening line."""
    server = _Server(_uvicorn_config(create_app(gateway, api_key, metrics_extra), host, port))

    async def main() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            if task.done():
                task.result()
                return
            await asyncio.sleep(0.02)
        # the gateway process's startup heap (transformers, the tokenizer, the app: ~400k objects) out of
        # the full collections' walk, as the replicas' (engine/warmup.py) and vLLM's API server's
        # (freeze_gc_heap at startup): one full collection stalled this event loop ~150 ms, every
        # request in flight then waited for it (a 96-request burst's TTFT p50 3x)
        freeze_startup_heap()
        announce(f"layerscope serve listening on http://{host}:{_bound_port(server)}")
        await task

    asyncio.run(main())
