"""The jsgl HTTP server: SGLang's native API plus the OpenAI API over one Engine.

    create_app(engine, api_key=None) -> FastAPI app (the caller owns the engine)
    serve(EngineConfig(...), host="127.0.0.1", port=30000, api_key=None)   # `jsgl serve`

Endpoints: POST /generate, /tokenize, /v1/completions, /v1/chat/completions, /flush_cache,
/abort_request, /concate_and_append_request; GET /v1/models, /v1/models/{id}, /get_model_info (= /model_info),
/get_server_info (= /server_info), /get_load, /metrics (Prometheus), /health, /health_generate. With an API key every
endpoint but /health wants `Authorization: Bearer <key>`. Errors are `{"error": {"message", "type",
"param", "code"}}`: 400 for bad input, 401 for a bad key, 500 when generation itself fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import secrets
import sys
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from jsgl.errors import InvalidRequestError, OverloadedError
from jsgl.server import generate_api, openai_api, openai_chat
from jsgl.server.common import APIError, ServerState, UnloggedError, error_body, server_state
from jsgl.server.limits import BodySizeLimit, ServerLimits
from jsgl.server.protocol import JSGL_EXTENSIONS, AbortRequest, ConcateAndAppendRequest

log = logging.getLogger("jsgl.server")

OPEN_PATHS = frozenset({"/health"})  # reachable without the key, so launchers and probes can poll it
HEALTH_GENERATE_TIMEOUT_S = 20.0  # a one-token request slower than this means the engine is stuck or swamped


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would get between a streaming response and the
    client's disconnect notice)."""

    def __init__(self, app: ASGIApp, api_key: str, admin_key: str | None = None) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()
        self.admin = f"Bearer {admin_key}".encode() if admin_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            # Constant time (do not leak the key); both compared always, so timing does not say which.
            ok = hmac.compare_digest(given, self.expected)
            ok = hmac.compare_digest(given, self.admin or self.expected) or ok
            if not ok:
                body = error_body("invalid or missing API key (send Authorization: Bearer <key>)", 401,
                                  "authentication_error")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> str:
    """One line per bad field. Union fields make pydantic report every alternative, tagged with the
    alternative's type in `loc` ("sampling_params.list[...]"); keep the first report per field."""
    parts: dict[str, str] = {}
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        loc = [x for x in loc if not (x[:1].isupper() or "[" in x or x in _TYPE_TAGS)]
        key = ".".join(loc) or "body"
        if key == "body" and err.get("type") in ("dict_type", "model_attributes_type"):
            return "the request body must be a JSON object (send it with Content-Type: application/json)"
        parts.setdefault(key, f"{key}: {err.get('msg')}")
    # A field whose alternatives all failed also reports the field itself ("should be a valid list"):
    # the deeper report says more.
    keep = [msg for key, msg in parts.items() if not any(k.startswith(key + ".") for k in parts)]
    return "invalid request: " + "; ".join(keep[:5])


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal"})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(_validation_message(exc), 400), status_code=400)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.status, exc.type, exc.param), status_code=exc.status)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 400), status_code=400)

    @app.exception_handler(OverloadedError)
    async def _overloaded(request: Request, exc: OverloadedError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 503, "server_overloaded"), status_code=503,
                            headers={"Retry-After": "1"})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # The client gets an id to quote, never the exception text (it may hold another request's input).
        error_id = secrets.token_hex(6)
        log.exception("request failed (error id %s)", error_id)
        return _internal_error(request, error_id)

    @app.exception_handler(UnloggedError)
    async def _unlogged(request: Request, exc: UnloggedError) -> JSONResponse:
        error_id = secrets.token_hex(6)
        log.error("request failed (error id %s): %s; no details, as the request asked (no_logs)", error_id, exc.kind)
        return _internal_error(request, error_id)


def _internal_error(request: Request, error_id: str) -> JSONResponse:
    stopped = not server_state(request).engine.alive()
    status = 503 if stopped else 500
    message = "the engine is shut down" if stopped else "internal server error"
    return JSONResponse(error_body(f"{message} (error id {error_id})", status, "server_error"),
                        status_code=status)


def _install_admin_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        alive = server_state(request).engine.alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> JSONResponse:
        """SGLang's deep health check: one token through the whole engine (queue, step, sampling)."""
        engine = server_state(request).engine
        try:
            handle = await asyncio.to_thread(engine.submit, [0], {"max_new_tokens": 1, "temperature": 0})
            out = await asyncio.to_thread(handle.result, HEALTH_GENERATE_TIMEOUT_S)
        except Exception as exc:  # any failure is "unhealthy", never a 500 of the check itself
            log.warning("health_generate failed: %s", exc)
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        healthy = out.finish_reason is not None and out.completion_tokens == 1
        return JSONResponse({"status": "ok" if healthy else "unhealthy"}, status_code=200 if healthy else 503)

    @app.get("/get_model_info")
    @app.get("/model_info")  # SGLang's newer name, which sglang-router asks for first
    async def model_info(request: Request) -> dict[str, Any]:
        state = server_state(request)
        tok, cfg = state.engine.tokenizer, state.engine.model_config
        # The chat template and special tokens let an HTTP client (RuntimeEndpoint) compute role markers.
        return {"model_path": state.model_name, "tokenizer_path": state.model_name, "is_generation": True,
                "model_type": cfg.architecture,
                "max_context": state.max_context, "vocab_size": int(cfg.vocab_size),
                "chat_template": getattr(tok, "chat_template", None), "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                # jsgl's own request fields: RuntimeEndpoint sends them only to a server that lists them here.
                "jsgl_extensions": list(JSGL_EXTENSIONS)}

    @app.get("/get_server_info")
    @app.get("/server_info")  # the name SGLang's RuntimeEndpoint.get_server_info() calls
    async def server_info(request: Request) -> dict[str, Any]:
        state = server_state(request)
        engine = state.engine
        stats = engine.stats()
        # SGLang's ServerArgs names for what sglang-router reads (the model's id for its /v1/models, dp_size).
        sglang_names = {"model_path": state.model_name, "tokenizer_path": state.model_name,
                        "served_model_name": state.model_name, "dp_size": 1, "tp_size": engine.config.tp,
                        "max_total_tokens": stats["total_slots"]}
        return {**dataclasses.asdict(engine.config), **stats, **sglang_names, "max_context": state.max_context,
                "active_requests": len(state.registry),
                "client_aborts": state.registry.client_aborts, "idle": engine.idle(), "version": _version()}

    @app.get("/get_load")
    async def get_load(request: Request) -> list[dict[str, int]]:
        """SGLang's load report, one entry per data-parallel rank (jsgl has one): sglang-router's power_of_two
        policy and its /get_loads read `num_tokens`, the KV slots requests hold (the evictable prefix cache not
        counted, as SGLang counts them)."""
        engine = server_state(request).engine
        stats = engine.stats()
        held = stats["total_slots"] - stats["free_slots"] - engine.prefix_cache.evictable_size()
        return [{"dp_rank": 0, "num_reqs": stats["running_requests"] + stats["queued_requests"],
                 "num_waiting_reqs": stats["queued_requests"], "num_tokens": max(held, 0)}]

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus' text format (engine/metrics.py): SGLang's metric names; 404 with --disable-metrics."""
        exporter = server_state(request).metrics
        if exporter is None:
            raise APIError("metrics are off on this server (--disable-metrics)", status=404, type_="not_found_error")
        return Response(await asyncio.to_thread(exporter.exposition), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> dict[str, Any]:
        _require_admin(request, "flushing the cache")
        if not await asyncio.to_thread(server_state(request).engine.flush_cache):
            raise APIError("the cache was not flushed: requests are running; retry when idle", status=400)
        return {"success": True, "message": "Cache flushed."}

    @app.post("/concate_and_append_request")
    async def concate_and_append(req: ConcateAndAppendRequest) -> dict[str, Any]:
        """Called by SGLang's frontend when a fork joins with mode="concate_and_append". SGLang's parallel
        encoding glued the branches' KV together without recomputing it (positions shifted: an approximation).
        jsgl keeps the joined state exact instead: the client has appended the branches' text, so its next
        /generate reuses the fork point's prefix from the radix cache and prefills the branches' text after
        it. Nothing is left to do here; the ids are the client's stream ids, which /generate never sees."""
        return {"success": True, "src_rids": req.src_rids, "dst_rid": req.dst_rid}

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest, request: Request) -> dict[str, Any]:
        state = server_state(request)
        if req.abort_all:
            _require_admin(request, "abort_all")
            rids = state.registry.ids()
        elif req.rid:
            rids = [req.rid]
        else:
            raise APIError("give `rid` or `abort_all: true`", param="rid")
        for rid in rids:
            state.engine.abort(rid)  # unknown or finished ids are a no-op in the engine
        return {"success": True, "aborted": rids}


def _require_admin(request: Request, action: str) -> None:
    state = server_state(request)
    if not state.limits.is_admin(request.headers.get("authorization"), state.api_key):
        raise APIError(f"{action} acts on every client's requests: it needs the admin key (--admin-key)",
                       status=403, type_="permission_error")


def _version() -> str:
    from jsgl import __version__

    return __version__


def create_app(engine: Any, api_key: str | None = None, model_name: str | None = None,
               owns_engine: bool = False, limits: ServerLimits | None = None, metrics: bool = True) -> FastAPI:
    """The ASGI app over a running Engine; with `owns_engine` it shuts the engine down on app shutdown; with
    `metrics` it turns on the engine's Prometheus metrics and serves them at /metrics."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            await asyncio.to_thread(engine.shutdown)
            print("jsgl: engine stopped", file=sys.stderr, flush=True)

    app = FastAPI(title="jsgl", version=_version(), lifespan=lifespan)
    limits = limits or ServerLimits()
    name = model_name or engine.config.model
    app.state.jsgl = ServerState(engine=engine, model_name=name, api_key=api_key, limits=limits,
                                 metrics=engine.enable_metrics(name) if metrics else None)
    _install_error_handlers(app)
    _install_admin_routes(app)
    app.include_router(generate_api.router)
    app.include_router(openai_api.router)
    app.include_router(openai_chat.router)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    if api_key:  # added last, so it runs first: no body is read for a caller without the key
        app.add_middleware(APIKeyMiddleware, api_key=api_key, admin_key=limits.admin_key)
    return app


def serve(engine_config: Any, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
          log_level: str | None = None, limits: ServerLimits | None = None, timeout_keep_alive: int = 5,
          limit_concurrency: int | None = None, metrics: bool = True) -> None:
    """Load the engine and serve until SIGINT/SIGTERM (uvicorn's graceful shutdown, then the engine's)."""
    import uvicorn

    from jsgl.engine.engine import Engine

    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach the port can use the model", host)
    engine = Engine(config=engine_config)
    app = create_app(engine, api_key=api_key, owns_engine=True, limits=limits, metrics=metrics)
    print(f"jsgl: serving {engine_config.model} at http://{host}:{port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level or os.environ.get("JSGL_LOG_LEVEL", "warning"),
                timeout_graceful_shutdown=5, timeout_keep_alive=timeout_keep_alive,
                limit_concurrency=limit_concurrency)
