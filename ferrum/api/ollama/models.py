"""Ollama's model routes: what is served and loaded (/api/tags, /api/show, /api/ps) and the
model store through the API (/api/pull, /api/delete, /api/copy).

Rules:
- A model's facts come from its store manifest, else from its GGUF header (a model given as a
  file, or any model once loaded); what is unknown is an empty string or 0, never missing:
  clients read these fields without checking. Reading them touches files: a worker thread.
- /api/pull stores and serves a model under the name the client pulled (Ollama's naming),
  not `ferrum pull`'s "org/repo:QUANT", so that the client's next request finds it.
  "success" comes only once the model is served. Pulls run on threads of their own
  (`PullWorkers`: two at once, the rest wait), never on the default pool. A pull whose
  client hangs up (streamed or not) is cancelled, and a pull that fails or is cancelled
  leaves no part files (`pull.pull`'s `resume=False`).
- Only the store's own models can be deleted or copied: not built-in models, nor files given
  to `--model`. A server without a store refuses all three.
- A copy or pull never takes a built-in model's name, nor a name or alias the server serves
  (a pull may update the store's own model of its name): `Registry.add` would swap the served
  model for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ferrum.api.auth import require_admin
from ferrum.api.hangups import unless_gone
from ferrum.api.loaded import ServedModel, context_length
from ferrum.api.ollama.answers import NDJSON, ndjson_line, rfc3339
from ferrum.api.ollama.bodies import CopyBody, ModelRef, PullBody, parse
from ferrum.api.serving import ServerState
from ferrum.engine.contracts import ModelInfo
from ferrum.errors import FerrumError, InvalidRequest
from ferrum.models.adapters import adapter_names
from ferrum.models.builtin import refuse_builtin_name
from ferrum.models.errors import InvalidModelFile, ModelNotFound
from ferrum.models.gguf_file import read_gguf
from ferrum.models.memory import model_files
from ferrum.models.projectors import capabilities as extra_capabilities
from ferrum.models.pull import PullProgress, pull
from ferrum.models.reference import parse_reference
from ferrum.models.registry import ModelSpec
from ferrum.models.store import Manifest, ModelStore, check_name

if TYPE_CHECKING:
    from ferrum.api.ollama import Route

log = logging.getLogger("ferrum.api")

# What a keep-forever model's expires_at says: Ollama's own "forever" (the longest Go duration).
_FOREVER_S = (2**63 - 1) / 1e9


# -- the models -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Facts:
    """What /api/tags, /api/show and /api/ps say of a model: its store manifest's facts, else
    its GGUF header's (a model given as a file, or any model once loaded); unknown: empty."""

    name: str
    modified: float
    size: int = 0
    digest: str = ""
    family: str = ""
    quant: str = ""
    context_length: int = 0
    chat_template: bool = False
    vision: bool = False  # served with a projector (`--mmproj`)


def _facts(
    spec: ModelSpec, manifest: Manifest | None, info: ModelInfo | None, started: float
) -> _Facts:
    """Reads files: call it in a worker thread."""
    base = _Facts(spec.name, spec.created or started, vision="vision" in extra_capabilities(spec))
    if manifest is not None:
        return dataclasses.replace(
            base,
            size=manifest.size,
            digest=manifest.sha256,
            family=manifest.architecture,
            quant=manifest.quant or "",
            context_length=manifest.context_length or 0,
            chat_template=manifest.has_chat_template,
        )
    # A built-in model's file is found only once loaded: locating it may assemble it.
    path = info.path if info is not None else spec.source.partition("file:")[2]
    try:
        gguf = read_gguf(path) if path else None
    except InvalidModelFile:
        gguf = None
    if gguf is None:
        return base
    return dataclasses.replace(
        base,
        size=sum(f.stat().st_size for f in model_files(path) if f.is_file()),
        family=gguf.architecture,
        quant=gguf.quant or "",
        context_length=gguf.context_length or 0,
        chat_template=gguf.has_chat_template,
    )


async def _all_facts(state: ServerState, specs: list[ModelSpec]) -> list[_Facts]:
    infos = {  # on the event loop
        m.spec.name: m.model.info
        for m in state.models.loaded()
        if isinstance(m.model, ServedModel)
    }

    def read() -> list[_Facts]:
        store = state.store.list() if state.store is not None else []
        manifests = {m.name.lower(): m for m in store}
        return [
            _facts(s, manifests.get(s.name.lower()), infos.get(s.name), state.created)
            for s in specs
        ]

    return await asyncio.to_thread(read)


def _details(f: _Facts) -> dict[str, Any]:
    # Strings even when unknown: clients read these without checking.
    return {
        "parent_model": "",
        "format": "gguf",
        "family": f.family,
        "families": [f.family] if f.family else [],
        "parameter_size": "",
        "quantization_level": f.quant,
    }


def _tag(f: _Facts) -> dict[str, Any]:
    return {
        "name": f.name,
        "model": f.name,
        "modified_at": rfc3339(f.modified),
        "size": f.size,
        "digest": f.digest,
        "details": _details(f),
    }


def _named(state: ServerState, name: str) -> ModelSpec:
    spec = state.models.lookup(name)
    if spec is None:
        raise ModelNotFound(name, [s.name for s in state.models.specs()])
    return spec


def _show(state: ServerState, f: _Facts) -> dict[str, Any]:
    template = ""
    embeds = False
    kv_cache: dict[str, Any] = {}
    for m in state.models.loaded():
        if m.spec.name == f.name and isinstance(m.model, ServedModel):
            template = m.model.formatter.template_text
            kv_cache = _kv_cache(m.model)
        embeds = embeds or (m.spec.name == f.name and not isinstance(m.model, ServedModel))
    model_info: dict[str, Any] = {"general.architecture": f.family}
    if f.family and f.context_length:
        model_info[f"{f.family}.context_length"] = f.context_length
    capabilities = ["embedding"] if embeds else ["completion"]
    if not embeds and (f.chat_template or template):
        capabilities.append("tools")  # tools ride on the chat template (`prompting/tool_calls.py`)
    if f.vision:
        capabilities.append("vision")
    return {
        "modelfile": "",
        "parameters": "",
        "template": template,
        "details": _details(f),
        "model_info": model_info,
        "capabilities": capabilities,
        "modified_at": rfc3339(f.modified),
    } | ({"kv_cache": kv_cache} if kv_cache else {})


def add_model_routes(route: Route, state: ServerState) -> None:
    @route("GET", "/api/tags")
    async def tags(request: Request) -> Response:
        specs = state.models.specs()
        facts = await _all_facts(state, specs)
        tags = [_tag(f) for f in facts]
        for spec, tag in zip(specs, list(tags), strict=True):  # LoRA adapters: BASE:NAME
            tags += [{**tag, "name": n, "model": n} for n in adapter_names(spec)]
        return JSONResponse({"models": tags})

    @route("POST", "/api/show")
    async def show(request: Request) -> Response:
        body = await parse(request, ModelRef)
        (facts,) = await _all_facts(state, [_named(state, body.ref)])
        return JSONResponse(_show(state, facts))

    @route("GET", "/api/ps")
    async def ps(request: Request) -> Response:
        loaded = state.models.loaded()
        facts = await _all_facts(state, [m.spec for m in loaded])
        forever = time.time() + _FOREVER_S  # also the latest date a model may say
        models = [
            _tag(f)
            | {
                "size": m.size or f.size,
                "size_vram": 0,
                "expires_at": rfc3339(min(m.expires_at or forever, forever)),
                "context_length": context_length(m.model),
            }
            | ({"kv_cache": _kv_cache(m.model)} if isinstance(m.model, ServedModel) else {})
            for m, f in zip(loaded, facts, strict=True)
        ]
        return JSONResponse({"models": models})


# -- the store ------------------------------------------------------------------------------


def _store(state: ServerState) -> ModelStore:
    if state.store is None:
        raise InvalidRequest("this server has no model store: pull, copy and delete are off")
    return state.store


def _served(manifest: Manifest) -> ModelSpec:
    """A store model as the registry serves it (as `catalog.py` builds one, minus presets)."""
    first = manifest.files[0]
    return ModelSpec(manifest.name, lambda: first, manifest.source, manifest.added)


async def _stored(
    state: ServerState, name: str, action: str
) -> tuple[ModelStore, ModelSpec | None, Manifest]:
    """The store's model that a delete or copy names (served or only stored): 404 when nobody
    knows it, 400 for a built-in model or a file given to `--model`, not the store's own."""
    store = _store(state)
    spec = state.models.lookup(name)
    try:
        manifest = await asyncio.to_thread(store.resolve, spec.name if spec else name)
    except ModelNotFound:
        if spec is None:
            raise ModelNotFound(name, [s.name for s in state.models.specs()]) from None
        builtin = spec.source.startswith("builtin:")
        what = "a built-in model" if builtin else "not in the model store"
        raise InvalidRequest(f"model {name!r} is {what}: it cannot be {action}") from None
    if manifest.source.startswith("builtin:"):
        raise InvalidRequest(f"model {name!r} is a built-in model: it cannot be {action}")
    return store, spec, manifest


async def _refuse_taken(
    state: ServerState, store: ModelStore, name: str, action: str, param: str
) -> None:
    """400 unless a copy or pull may store a model as `name`: not under a built-in's name,
    nor under any name or alias the registry serves, which `Registry.add` would swap for the
    new model (the models a server was started with are its operator's choice). The one
    exception: a pull of the store's own model of that very name, an update."""
    refuse_builtin_name(name, action, param)
    spec = state.models.lookup(name)
    if spec is None:
        return
    if action == "pulled over" and await asyncio.to_thread(_own_model, store, spec, name):
        return
    raise InvalidRequest(
        f"{name!r} names the served model {spec.name!r}: it cannot be {action}; choose "
        "another name",
        param=param,
    )


def _own_model(store: ModelStore, spec: ModelSpec, name: str) -> bool:
    """Whether `spec` serves the store's model named `name` (reads its manifest)."""
    if spec.name.lower() != name.lower() or spec.source.startswith("builtin:"):
        return False
    try:
        return store.get(name).source == spec.source
    except ModelNotFound:
        return False


def _progress(p: PullProgress) -> dict[str, Any]:
    line: dict[str, Any] = {"status": p.status}
    if p.total:
        line.update(digest=p.file, total=p.total, completed=p.completed)
    return line


async def _pull(
    state: ServerState, store: ModelStore, ref: str, lines: asyncio.Queue[dict[str, Any] | None]
) -> None:
    """Runs one pull in a worker thread, its progress forwarded into `lines` as Ollama's
    (None ends them). "success" comes only once the registry serves the model, so a client
    that reads it can use the model at once; a failure is the last line, `{"error"}`."""
    loop = asyncio.get_running_loop()

    def progress(p: PullProgress) -> None:  # on the pull's worker thread
        if p.status != "success":
            loop.call_soon_threadsafe(lines.put_nowait, _progress(p))

    def job(cancel: threading.Event) -> Manifest:
        return pull(store, ref, progress=progress, name=ref, cancel=cancel, resume=False)

    try:
        manifest = await state.pulls.run(job)
        if manifest.base is None:  # an adapter: loaded on its base (lora_routes, next start)
            state.models.add(_served(manifest))
        lines.put_nowait({"status": "success"})
    except FerrumError as exc:
        lines.put_nowait({"error": exc.message, "status_code": exc.status})
    except Exception as exc:  # no client may be left reading: every failure ends the lines
        log.exception("pulling %s failed", ref)
        lines.put_nowait({"error": f"pulling {ref} failed: {exc}", "status_code": 500})
    finally:
        lines.put_nowait(None)


def add_store_routes(route: Route, state: ServerState) -> None:
    pulls: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references

    @route("POST", "/api/pull")
    async def pull_model(request: Request) -> Response:
        """Streams the pull's progress; its model is served once it is complete. A client
        that hangs up cancels its pull."""
        require_admin(request, "pulling a model")
        body = await parse(request, PullBody)
        store = _store(state)
        if parse_reference(body.ref).kind == "file":
            # A remote client must not make the server read (or probe) files on its disk.
            raise InvalidRequest("local files are added with `ferrum pull` only", param="model")
        check_name(body.ref)  # the name it is stored under: refused now, not after a download
        await _refuse_taken(state, store, body.ref, "pulled over", "model")
        lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        task = asyncio.ensure_future(_pull(state, store, body.ref, lines))
        pulls.add(task)
        task.add_done_callback(pulls.discard)
        if body.stream:
            return StreamingResponse(_pull_lines(lines, task), media_type=NDJSON)
        try:
            last = await unless_gone(request, _last_line(lines), None)
        finally:
            task.cancel()  # the client hung up; nothing once the pull has ended
        if "error" in last:
            return JSONResponse({"error": last["error"]}, status_code=last["status_code"])
        return JSONResponse(last)

    @route("DELETE", "/api/delete")
    async def delete(request: Request) -> Response:
        require_admin(request, "deleting a model")
        body = await parse(request, ModelRef)
        store, spec, manifest = await _stored(state, body.ref, "deleted")

        def forget() -> None:  # the registry calls it in a worker thread
            store.remove(manifest.name)

        if spec is None:
            await asyncio.to_thread(forget)
        else:
            await state.models.remove(spec.name, forget)
        return Response(status_code=200)

    @route("POST", "/api/copy")
    async def copy(request: Request) -> Response:
        require_admin(request, "copying a model")
        body = await parse(request, CopyBody)
        store, _, source = await _stored(state, body.source, "copied")
        await _refuse_taken(state, store, body.destination, "copied over", "destination")
        manifest = await asyncio.to_thread(store.copy, source.name, body.destination)
        if manifest.base is None:  # an adapter is served on its base, never alone
            state.models.add(_served(manifest))
        return Response(status_code=200)


async def _pull_lines(
    lines: asyncio.Queue[dict[str, Any] | None], pulling: asyncio.Task[None]
) -> AsyncIterator[str]:
    """The pull's lines; Starlette ends this generator when the client hangs up, which
    cancels the pull (in `finally`)."""
    try:
        while (line := await lines.get()) is not None:
            line.pop("status_code", None)
            yield ndjson_line(line)
    finally:
        pulling.cancel()


async def _last_line(lines: asyncio.Queue[dict[str, Any] | None]) -> dict[str, Any]:
    last: dict[str, Any] = {}
    while (line := await lines.get()) is not None:
        last = line
    return last


def _kv_cache(model: ServedModel) -> dict[str, Any]:
    """What a loaded model's KV cache is made of (ferrum's own field, beside Ollama's)."""
    info = model.info
    return {
        "type_k": info.cache_type_k,
        "type_v": info.cache_type_v,
        "flash_attn": info.flash_attn,
        "bytes_per_token": info.kv_bytes_per_cell,
        "bytes": info.kv_bytes_per_cell * info.n_ctx,
    }

