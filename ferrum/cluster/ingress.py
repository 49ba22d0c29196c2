"""The cluster's HTTP front: the same routes as `ferrum serve`, relayed to the replicas.

Every request is relayed whole to one replica (`FerrumReplica.handle`) through a Ray Serve
handle whose router (`routers.py`) picks the replica from the request's `RouteKey`; the
answer streams back as the replica's app sends it. `/metrics` and `/health` are the
cluster's own: every replica's figures (from the board) with a `replica` label, and the
cluster's status; so are `/props` and `/slots`, every replica's merged from what each posted
(`gather.py`, with `ferrum serve`'s rule for whose request ids a key sees); the browser pages
are served here (`ferrum.web`), while replicas start too.

Faults: a replica that fails before answering is tried once more on another (nothing was
generated yet); one that fails mid-answer ends the stream with an error in the route's own
dialect (an SSE error event, Ollama's `{"error"}` line), never a hang. A client that hangs
up cancels the replica's stream, and so its engine requests.

Annotations are evaluated (no `from __future__ import annotations`): FastAPI reads the
route methods' parameter types after Ray Serve has wrapped them.
"""

import asyncio
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from ferrum.api.app import MAX_BODY_BYTES, check_gate
from ferrum.api.auth import Caller, Keys, cache_scope, caller_of
from ferrum.api.dialects import dialect_for, error_response, translation
from ferrum.api.slots import visible
from ferrum.api.transport import read_body
from ferrum.cluster.board import Board, Post, board_name
from ferrum.cluster.gather import merge_props, props_answers, short_id, slot_entries
from ferrum.cluster.keys import (
    PromptKeys,
    key_registry,
    parse_body,
    prompt_text,
    route_key,
)
from ferrum.cluster.policy import RouteKey
from ferrum.cluster.replica import REPLICA_HEADER, Head, Relayed
from ferrum.cluster.settings import ClusterSettings
from ferrum.errors import FerrumError, ServiceUnavailable
from ferrum.metrics import CONTENT_TYPE
from ferrum.models.adapters import attach as attach_adapters
from ferrum.models.catalog import serve_specs
from ferrum.models.presets import load_presets
from ferrum.models.registry import Lease
from ferrum.models.store import ModelStore, default_models_dir
from ferrum.models.store_adapters import attach_stored
from ferrum.models.units import parse_duration
from ferrum.server_metrics import merge_replica_metrics
from ferrum.web import page_answer, read_static

log = logging.getLogger("ferrum.cluster")

_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"]+)"')
_PINS_KEPT = 100_000
_ATTEMPTS = 2


class Relay:
    """The ingress's work, in a plain class: Ray Serve pickles the ingress class by value,
    and module functions its methods use would not travel with it."""

    def __init__(self, replicas: DeploymentHandle[Any], settings: ClusterSettings):
        self.replicas = replicas
        self.settings = settings
        models = settings.models
        store = ModelStore(models.models_dir or default_models_dir())
        specs = serve_specs(models.model, store, load_presets(models.presets), models.alias)
        specs = attach_adapters(specs, models.lora)  # route keys carry the adapter set
        specs = attach_stored(specs, store.list())
        self.keys = key_registry(
            specs,
            settings.server.chat_template,
            parse_duration(models.keep_alive),
            settings.engine.ctx_size,
        )
        self._keys_started = False
        self._no_keys: dict[str, float] = {}  # model → until when it is not tried again
        self.board = self._board()
        self._pins: OrderedDict[str, str] = OrderedDict()  # response id → replica holding it
        server = settings.server
        self.gate_keys = Keys.from_config(
            server.api_key, server.admin_key, server.keys_file, server.open_admin
        )
        self.pages = None if server.no_webui else read_static()

    # -- the cluster's own routes -----------------------------------------------------------

    def _board(self) -> Any:
        return Board.options(  # type: ignore[attr-defined]
            name=board_name(self.settings.cluster.app_name), get_if_exists=True
        ).remote()

    async def _posts(self) -> dict[str, Post]:
        """What the replicas posted. A board gone with the ingress that made it (a redeploy)
        is made again; replicas post to it within a stats period."""
        max_age = 3 * self.settings.cluster.stats_period + 2.0
        try:
            posts: dict[str, Post] = await self.board.read.remote(max_age)
        except RayActorError:
            self.board = self._board()
            posts = await self.board.read.remote(max_age)
        return posts

    async def metrics(self, request: Request) -> Response:
        try:
            check_gate(self.gate_keys, self.settings.server.public_metrics, request)
        except FerrumError as exc:
            return _error(request.url.path, exc)
        posts = await self._posts()
        text = merge_replica_metrics({short_id(r): p[0] for r, p in posts.items()})
        return Response(text, media_type=CONTENT_TYPE)

    async def health(self, request: Request) -> JSONResponse:
        try:
            check_gate(self.gate_keys, self.settings.server.public_metrics, request)
        except FerrumError as exc:  # this app has no error handlers: a raise would be a 500
            return _error(request.url.path, exc)
        posts = await self._posts()
        replicas = {short_id(r): json.loads(p[1]) for r, p in posts.items()}
        ok = bool(replicas) and all(h.get("status") == "ok" for h in replicas.values())
        body: dict[str, Any] = {"status": "ok" if ok else "error"}
        if not self.gate_keys.required or caller_of(request).tenant:
            body["replicas"] = replicas  # which models run where: for a key only
        return JSONResponse(body, status_code=200 if ok else 503)

    async def props_or_slots(self, request: Request) -> Response:
        """The dashboard's /props and /slots over every replica (from their posts); a model
        no replica holds is relayed, for the replica's own answer (loaded: false, a 404)."""
        path = request.url.path
        try:
            check_gate(self.gate_keys, self.settings.server.public_metrics, request)
        except FerrumError as exc:
            return _error(path, exc)
        model = request.query_params.get("model")
        views = {r: p[2] for r, p in (await self._posts()).items()}
        if path == "/slots":
            entries = slot_entries(views, model)
            if entries or model is None:
                caller, required = caller_of(request), self.gate_keys.required
                return JSONResponse(visible(entries, caller, required))
        elif answers := props_answers(views, model):
            return JSONResponse(merge_props(answers))
        return await self.relay(request)

    def page(self, request: Request) -> Response | None:
        """A browser page or its file, from the ingress itself (it shows every replica, and
        loads while replicas start); None: not one here (`/` asked by a non-browser)."""
        if self.pages is None:
            return None
        return page_answer(request.url.path, request.headers.get("accept", ""), self.pages)

    # -- everything else, relayed -----------------------------------------------------------

    async def relay(self, request: Request) -> Response:
        path = request.url.path
        try:  # the key and size first, as `ferrum serve` checks them, before any work
            check_gate(self.gate_keys, self.settings.server.public_metrics, request)
            body = await read_body(request, MAX_BODY_BYTES)  # a chunked body too
        except FerrumError as exc:
            return _error(path, exc)
        key = await self._key(path, body, caller_of(request))
        relayed = Relayed(
            request.method, path, request.url.query.encode(), list(request.headers.raw), body
        )
        # Only a generation is tried again: a pull or a delete may have happened already.
        attempts = _ATTEMPTS if translation(path) is not None else 1
        for attempt in range(attempts):
            stream = cast(
                DeploymentResponseGenerator[Any],
                self.replicas.options(stream=True).handle.remote(relayed, route=key),
            )
            try:
                head: Head = await stream.__anext__()
            except (RayActorError, ActorUnavailableError) as exc:  # nothing reached the client
                stream.cancel()  # type: ignore[no-untyped-call]
                log.warning(
                    "replica failed before answering %s (try %d): %s", path, attempt + 1, exc
                )
                continue
            except Exception:
                stream.cancel()  # type: ignore[no-untyped-call]
                log.exception("replica could not answer %s", path)
                break
            pin_to = _header(head, REPLICA_HEADER) if path.endswith("/responses") else ""
            response = StreamingResponse(self._body(stream, path, head, pin_to))
            response.status_code = head.status
            response.raw_headers = head.headers
            return response
        return _error(path, ServiceUnavailable("no replica could answer; retry shortly"))

    async def _key(self, path: str, body: bytes, caller: Caller) -> RouteKey:
        pin = self._pin_for(path, body)
        if pin:
            return RouteKey(pin=pin)
        router = self.settings.cluster.router
        parsed = parse_body(path, body) if router != "pow2" else None
        if parsed is None:
            return RouteKey()
        model, openai_body = parsed
        if router == "text-prefix":
            return RouteKey(model, (), prompt_text(openai_body))
        lease = await self._keys_for(model)
        if lease is None:
            return RouteKey(model)
        try:
            block_size = self.settings.engine.block_size
            # The scope the replica will give it (serving.submit): its blocks are chained so.
            shared = self.settings.server.share_prefix_cache
            scope = cache_scope(caller, openai_body.cache_salt, shared)
            return await asyncio.to_thread(route_key, lease.model, openai_body, block_size, scope)
        finally:
            lease.release()

    async def _keys_for(self, model: str) -> Lease[PromptKeys] | None:
        """The model's prompt keys, loaded on first use; None for a model that cannot load
        here (unknown: the replica answers the 404), not tried again for a minute."""
        if not self._keys_started:
            self.keys.start()  # the reaper: idle vocabularies are unloaded
            self._keys_started = True
        if time.monotonic() < self._no_keys.get(model, 0.0):
            return None
        try:
            return await self.keys.acquire(model)
        except Exception as exc:  # noqa: BLE001 - routing goes on without a key
            log.warning("no route keys for model %r: %s", model, exc)
            self._no_keys[model] = time.monotonic() + 60.0
            return None

    def _pin_for(self, path: str, body: bytes) -> str:
        """The replica holding a Responses API continuation's history, or a stored response's."""
        if path.startswith(("/v1/responses/", "/responses/")):
            return self._pins.get(path.rsplit("/", 1)[-1], "")
        if path in ("/v1/responses", "/responses") and b"previous_response_id" in body:
            try:
                previous = json.loads(body).get("previous_response_id") or ""
            except (ValueError, AttributeError):
                return ""
            return self._pins.get(previous, "")
        return ""

    async def _body(self, stream: Any, path: str, head: Head, replica: str) -> AsyncIterator[bytes]:
        """The answer's chunks; `replica`: pin the response id found in them to it."""
        content_type = _header(head, "content-type")
        try:
            async for chunk in stream:
                if replica:
                    found = _RESPONSE_ID.search(chunk)
                    if found:
                        self._pin(found.group(1).decode(), replica)
                        replica = ""
                yield chunk
        except Exception as exc:  # the replica died mid-answer
            log.warning("replica failed while answering %s: %s", path, exc)
            yield _stream_error(
                path, content_type, f"the replica serving this request failed: {exc}"
            )
        finally:
            stream.cancel()  # a client gone: the replica's engine requests are aborted

    def _pin(self, response_id: str, replica: str) -> None:
        self._pins[response_id] = replica
        self._pins.move_to_end(response_id)
        while len(self._pins) > _PINS_KEPT:
            self._pins.popitem(last=False)


def _header(head: Head, name: str) -> str:
    return dict(head.headers).get(name.encode(), b"").decode()


def _error(path: str, exc: FerrumError) -> JSONResponse:
    return error_response(exc, path)  # the route's own dialect, as `ferrum serve` answers


def _stream_error(path: str, content_type: str, message: str) -> bytes:
    """How a stream that already began reports a failure, in the route's dialect (an SSE
    error event, Anthropic's `error` event, Ollama's `{"error"}` line), as `ferrum serve`'s
    own streams end."""
    if "ndjson" not in content_type and "event-stream" not in content_type:
        return b""  # a whole answer cut short: the client sees a truncated body
    return dialect_for(path).stream_error(ServiceUnavailable(message)).encode()


# No docs of its own: /docs and /openapi.json are relayed like any route, behind the key.
http = FastAPI(title="ferrum cluster", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(http)
class FerrumIngress:
    def __init__(self, replicas: DeploymentHandle[Any], settings: ClusterSettings):
        self.relay = Relay(replicas, settings)

    @http.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        return await self.relay.metrics(request)

    @http.get("/health")
    async def health(self, request: Request) -> JSONResponse:
        return await self.relay.health(request)

    @http.get("/props")
    async def props(self, request: Request) -> Response:
        return await self.relay.props_or_slots(request)

    @http.get("/slots")
    async def slots(self, request: Request) -> Response:
        return await self.relay.props_or_slots(request)

    @http.get("/")
    async def chat_page(self, request: Request) -> Response:
        return self.relay.page(request) or await self.relay.relay(request)

    @http.get("/dashboard")
    async def dashboard_page(self, request: Request) -> Response:
        return self.relay.page(request) or await self.relay.relay(request)

    @http.get("/web/{name}")
    async def page_file(self, request: Request, name: str) -> Response:
        return self.relay.page(request) or await self.relay.relay(request)

    @http.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(self, request: Request, path: str) -> Response:
        return await self.relay.relay(request)
