"""The chat-completions endpoint of agent runs: FastAPI on uvicorn, in the coordinator's event loop.

    POST /v1/episodes/<key>/chat/completions    the episode's key in the path (its `base_url`)
    POST /v1/chat/completions                   the key as the bearer token (an OpenAI `api_key`)
    GET  /v1/episodes/<key>/models, /v1/models  the one model served

Each episode is open while its RunEpisode runs (`episode`); its key is a random secret, so it
names and authorizes the episode at once. A path key that names no open episode is 404, a
missing or unknown bearer key 401, a malformed request 400, a generation that failed 503, each in
OpenAI's error shape. The recording itself is the episode's (`agent_episode.AgentRecorder`): the
gateway holds no state beyond the episodes open, all of which a crash ends (they are played again).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from starlette.exceptions import HTTPException

from pipelinerl.common.log import get_logger
from pipelinerl.common.metrics import counters, register_snapshot
from pipelinerl.coordinator.openai_api import Answer, ApiError, ChatRequest, parse_request

log = get_logger(__name__)

START_TIMEOUT_S = 10.0
PREFIX = "pipelinerl_coordinator_agent"
_COUNT_DOCS = {
    "calls_answered": "Chat-completions calls of agents answered.",
    "calls_refused": "Chat-completions calls of agents refused (4xx, 5xx).",
    "calls_continued": "Agent calls whose history extended their episode's tokens: its sample continued.",
    "calls_new_sample": "Agent calls whose history did not (rewritten, or after a cut turn): a new sample.",
}


class Episode(Protocol):
    """An open episode, as the gateway calls it."""

    async def complete(self, request: ChatRequest) -> Answer: ...


@dataclass
class CallCounts:
    """The gateway's calls since it started (Prometheus: `pipelinerl_coordinator_agent_*`)."""

    answered: int = 0
    refused: int = 0
    continued: int = 0
    """Calls whose history extended the episode's tokens: they continued its sample."""
    new_samples: int = 0
    """Calls after an episode's first whose history did not (rewritten, or after a cut turn)."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """The coordinator's own SIGTERM handling drains the process; uvicorn takes no signal."""
        yield


class AgentGateway:
    """Serves the open episodes on `host:port` (0: a free port); `public_url` is the base the agents
    are given (default `http://host:port`), for a gateway reached through another name; `model` the
    name of the one model it lists."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, public_url: str | None = None, model: str = "policy"
    ) -> None:
        self._host, self._port, self._public_url = host, port, public_url
        self._episodes: dict[str, Episode] = {}
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.counts = CallCounts()
        self.model = model
        self.app = self._routes()

    @property
    def url(self) -> str:
        """The base URL agents reach the gateway at."""
        if self._public_url:
            return self._public_url.rstrip("/")
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        """Bind and serve; the port is known once this returns."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.create_server((self._host, self._port), family=family)
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, lifespan="off", access_log=False, log_level="warning")
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="agent gateway")
        async with asyncio.timeout(START_TIMEOUT_S):
            while not self._server.started:
                if self._task.done():
                    await self._task  # raises why it could not start
                await asyncio.sleep(0.01)
        log.info("agent gateway serving", url=self.url)

    async def close(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await self._task

    def watch(self, registry: CollectorRegistry) -> None:
        """Expose the call counts on `registry` (`pipelinerl_coordinator_agent_*`)."""

        def snapshot() -> Iterator[Metric]:
            c = self.counts
            values = [c.answered, c.refused, c.continued, c.new_samples]
            yield from counters(PREFIX, _COUNT_DOCS, dict(zip(_COUNT_DOCS, values, strict=True)))

        register_snapshot(registry, snapshot)

    @contextlib.contextmanager
    def episode(self, episode: Episode) -> Iterator[tuple[str, str]]:
        """Open `episode` for as long as the block runs: (its base URL, its key)."""
        key = secrets.token_urlsafe(24)
        self._episodes[key] = episode
        try:
            yield f"{self.url}/v1/episodes/{key}", key
        finally:
            del self._episodes[key]

    def _routes(self) -> FastAPI:
        app = FastAPI(title="pipelinerl agent gateway", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def refused(request: Request, exc: ApiError) -> JSONResponse:
            self.counts.refused += 1
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
            code = "not_found" if exc.status_code == 404 else "invalid_request"
            body = ApiError(exc.status_code, str(exc.detail), None, code).body()
            return JSONResponse(body, status_code=exc.status_code)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            return JSONResponse(ApiError(400, str(exc.errors())).body(), status_code=400)

        @app.post("/v1/episodes/{key}/chat/completions")
        async def in_path(key: str, request: Request) -> Response:
            episode = self._episodes.get(key)
            if episode is None:
                raise ApiError(
                    404, "no open episode has this key (ended, or never opened)", None, "episode_not_found"
                )
            return await self._complete(episode, request)

        @app.post("/v1/chat/completions")
        async def by_bearer(request: Request) -> Response:
            return await self._complete(self._bearer(request), request)

        @app.get("/v1/episodes/{key}/models")
        async def models_in_path(key: str) -> dict[str, Any]:
            if key not in self._episodes:
                raise ApiError(404, "no open episode has this key", None, "episode_not_found")
            return self._models()

        @app.get("/v1/models")
        async def models(request: Request) -> dict[str, Any]:
            self._bearer(request)
            return self._models()

        return app

    def _bearer(self, request: Request) -> Episode:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        episode = self._episodes.get(key.strip()) if scheme.lower() == "bearer" else None
        if episode is None:
            raise ApiError(401, "an episode's key is the API key: missing, or no open episode has it",
                           None, "invalid_api_key")  # fmt: skip
        return episode

    def _models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "pipelinerl"}],
        }

    async def _complete(self, episode: Episode, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise ApiError(400, "the request body is not JSON", None, "invalid_json") from None
        chat = parse_request(body)
        answer = await episode.complete(chat)
        self.counts.answered += 1
        if not chat.stream:
            return JSONResponse(answer.completion())
        return StreamingResponse(answer.events(chat.include_usage), media_type="text/event-stream")
