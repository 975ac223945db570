"""The FastAPI app: lifespan (engine thread), error shape, health / metrics / models routes, and
`run_server`, which `specserve serve` calls."""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..config import EngineConfig
from .async_engine import AsyncEngine
from .common import Server, check_api_key, default_model_name, server
from .config import ServerConfig
from .metrics import Metrics
from .protocol import RequestError, error_body
from .routes_native import router as native_router
from .routes_openai import router as openai_router

log = logging.getLogger("specserve.server")


def create_app(config: EngineConfig, server_config: ServerConfig | None = None,
               engine_factory: Callable[[], Any] | None = None,
               on_load_failed: Callable[[BaseException], None] | None = None) -> FastAPI:
    """`engine_factory` builds the Engine in the engine thread (default: build_engine(config)); tests pass
    their own to control loading."""
    scfg = server_config or ServerConfig()
    if engine_factory is None:
        def engine_factory() -> Any:
            from ..engine.build import build_engine

            return build_engine(config)

    name = scfg.served_model_name or default_model_name(config.model)
    metrics = Metrics(name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aeng = AsyncEngine(engine_factory, metrics, scfg.log_interval, on_load_failed)
        app.state.server = Server(config, scfg, aeng, metrics, name)
        aeng.start()
        try:
            yield
        finally:
            aeng.stop()

    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible speculative-decoding server")
    _add_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(native_router)

    @app.get("/health")
    async def health(request: Request) -> Any:
        aeng = server(request).engine
        if aeng.ready:
            return {"status": "ok"}
        msg = "Loading model" if aeng.state == "loading" else f"model not available ({aeng.state}): {aeng.load_error}"
        return JSONResponse(error_body(msg, 503), status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        return Response(generate_latest(server(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def models(request: Request) -> Any:
        srv = server(request)
        card: dict[str, Any] = {"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "specserve",
                                "root": srv.config.model}
        if srv.engine.ready:
            card["max_model_len"] = srv.engine.engine.max_model_len
        return {"object": "list", "data": [card]}

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is the OpenAI shape {"error": {message, type, param, code}}; validation → 400."""

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return JSONResponse(error_body(str(e), e.status, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        found: list[tuple[str, str]] = []
        for err in e.errors():
            # pydantic tries each member of a union and puts the member's type in `loc`: name the field
            field = ".".join(str(x) for x in err.get("loc", ())[1:] if not _is_type_tag(x)) or "body"
            msg = err.get("msg", "invalid")
            if err.get("type") == "json_invalid":
                field, msg = "body", f"invalid JSON: {err.get('ctx', {}).get('error', msg)}"
            found.append((field, msg))
        # of a union's "Input should be a valid <type>" complaints keep only those with nothing better
        kept = [(f, m) for f, m in found if not m.startswith("Input should be a valid")
                or not any(g == f or g.startswith(f + ".") for g, n in found if not n.startswith("Input should be"))]
        kept = list(dict.fromkeys(kept))[:5]
        param = kept[0][0] if kept else None
        parts = [f"{f}: {m}" for f, m in kept]
        return JSONResponse(error_body("; ".join(dict.fromkeys(parts)), 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), e.status_code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", 500), status_code=500)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_type_tag(x: Any) -> bool:
    return isinstance(x, str) and (x in _TYPE_TAGS or "[" in x or "-" in x or x[:1].isupper())


def run_server(config: EngineConfig, server_config: ServerConfig) -> int:
    """Start uvicorn; the model loads in the background (GET /health says 503 until it is ready).
    Returns the exit status: 1 when the model failed to load or the engine stopped (a tensor-parallel rank
    died: the error names it)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failed: list[BaseException] = []
    holder: dict[str, uvicorn.Server] = {}

    def on_load_failed(e: BaseException) -> None:
        failed.append(e)
        holder["server"].should_exit = True

    app = create_app(config, server_config, on_load_failed=on_load_failed)
    uv = uvicorn.Server(uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level="info",
                                       timeout_graceful_shutdown=5))
    holder["server"] = uv
    log.info("specserve %s: serving %s on http://%s:%d (speculative: %s)", __version__, config.model,
             server_config.host, server_config.port, config.speculative_algorithm or "off")
    try:
        uv.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its orderly shutdown (engine and workers stopped)
        log.info("specserve: stopped on Ctrl-C")
    if failed:
        log.error("specserve: exiting: %s", failed[0])
    return 1 if failed else 0
