"""LoRA adapters changed while serving: llama-server's `GET/POST /lora-adapters` and vLLM's
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Listing is for every caller (a path shows as its file name only: the server's folders are
not the caller's business); every change is an admin's (`require_admin`), as loading and
unloading models are. A load takes the next id (ids never move: llama-server's clients pick
adapters by id) and reads only files the operator allowed (`loadable_path`), or a stored
adapter named by its store name; its checks and the file's digest (`file_digest`, part of
its requests' cache scope) run in a worker thread, so a slow disk stalls no other request.
A stored adapter made for another base model is a 400 naming it (`store_adapters`), and
llama.cpp refuses any other adapter of another base model, a 400. An unload stops new
requests from picking the adapter at once; the engine frees it when the last request using
it is done (`ferrum.engine.adapter_files`). Changes go to the registry's spec as well as the loaded
model, so a reload serves the same adapters under the same ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from ferrum.api.auth import require_admin
from ferrum.api.loaded import ServedModel
from ferrum.api.openai.bodies import LoraChoice
from ferrum.api.openai.routes import route
from ferrum.api.serving import ServerState, acquire_chat
from ferrum.errors import InvalidRequest, ModelLoadError, NotFound
from ferrum.models.adapters import (
    LoraAdapter,
    adapter_set,
    check_new_adapter,
    file_digest,
    loadable_path,
)
from ferrum.models.registry import ModelSpec
from ferrum.models.store import ModelStore
from ferrum.models.store_adapters import check_base, stored_adapter

__all__ = ["add_lora_routes"]


class LoadAdapter(BaseModel):
    """vLLM's body; `model` (ferrum's): the base when several models are served (else a
    `BASE:NAME` lora_name, else the default model)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: Annotated[str, Field(max_length=200)]
    lora_path: Annotated[str, Field(max_length=4096)] = ""
    model: str = ""


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    changes = _Changes(state)

    @route(app, "GET", "/lora-adapters")
    async def list_adapters(model: str = "") -> list[dict[str, Any]]:
        """llama-server's list: id, path (the file name) and the scale requests that pick
        no adapter get; ferrum adds its name and base model."""
        spec = state.models.resolve(model)
        return [
            {"id": i, "path": os.path.basename(a.path), "scale": a.default, "name": a.name,
             "model": spec.name}  # fmt: skip
            for i, a in enumerate(spec.adapters)
            if not a.removed
        ]

    @route(app, "POST", "/lora-adapters")
    async def set_default_scales(
        body: Annotated[list[LoraChoice], Field(max_length=64)], request: Request, model: str = ""
    ) -> dict[str, Any]:
        """llama-server's: the scales of requests that pick no adapter (unlisted: 0)."""
        require_admin(request, "setting LoRA scales")

        async def rescale(served: ServedModel) -> dict[str, Any]:
            chosen = dict(adapter_set(served.adapters, None, [(c.id, c.scale) for c in body]))
            new = tuple(
                dataclasses.replace(a, default=chosen.get(i, 0.0))
                for i, a in enumerate(served.adapters)
            )
            _publish(state, served, new)
            return {"success": True}

        return await changes.run(request, model, rescale)

    @route(app, "POST", "/v1/load_lora_adapter")
    async def load_adapter(body: LoadAdapter, request: Request) -> dict[str, Any]:
        return await changes.of_adapter(request, body, "loading a LoRA adapter", _load)

    @route(app, "POST", "/v1/unload_lora_adapter")
    async def unload_adapter(body: LoadAdapter, request: Request) -> dict[str, Any]:
        return await changes.of_adapter(request, body, "unloading a LoRA adapter", _unload)


# A change to one model's adapters: (server, the loaded base model, adapter name, body).
_Change = Callable[[ServerState, ServedModel, str, LoadAdapter], Awaitable[dict[str, Any]]]


class _Changes:
    """What every change shares: an admin's only (checked before anything else, so a user
    key learns nothing of the models), one at a time (ids are handed out in order), on the
    base model loaded and leased for the change's length."""

    def __init__(self, state: ServerState):
        self.state = state
        self.lock = asyncio.Lock()

    async def run(
        self, request: Request, model: str, act: Callable[[ServedModel], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        async with self.lock:
            lease = await acquire_chat(self.state, request, model)
            try:
                return await act(lease.model)
            finally:
                lease.release()

    async def of_adapter(
        self, request: Request, body: LoadAdapter, what: str, change: _Change
    ) -> dict[str, Any]:
        """vLLM's load and unload: the base model the body names, then `change`."""
        require_admin(request, what)
        spec, name = _base_of(self.state, body)
        return await self.run(request, spec.name, lambda m: change(self.state, m, name, body))


def _base_of(state: ServerState, body: LoadAdapter) -> tuple[ModelSpec, str]:
    """The base model a load or unload is for, and the adapter's own name."""
    base, colon, name = body.lora_name.rpartition(":")
    if body.model:
        return state.models.resolve(body.model), body.lora_name
    spec = state.models.lookup(base) if colon else None
    if spec is not None:
        return spec, name
    return state.models.resolve(""), body.lora_name


async def _load(
    state: ServerState, served: ServedModel, name: str, body: LoadAdapter
) -> dict[str, Any]:
    given = body.lora_path
    check_new_adapter(served.adapters, name)
    folders = [str(state.store.root)] if state.store is not None else []
    folders += list(state.lora_dirs)
    known = [a.path for s in state.models.specs() for a in s.adapters]
    # Stats, links and the file's digest: a slow disk stalls this load, not the event loop.
    spec = state.models.resolve(served.name)
    path, digest = await asyncio.to_thread(_checked, state.store, spec, given, (folders, known))
    core = served.engine.core
    try:
        i = await served.engine.on_engine_thread(lambda: core.adapters.load(path))
    except ModelLoadError:
        # llama.cpp's refusal: not an adapter, or one of another base model.
        raise InvalidRequest(
            f"lora_path {given!r} is not a LoRA adapter of model {served.name!r} (another "
            "base model, or not an adapter GGUF)",
            param="lora_path",
        ) from None
    if i != len(served.adapters):  # ids out of step: never serve one under another's id
        await served.engine.on_engine_thread(lambda: core.release_adapter(i))
        raise InvalidRequest(f"LoRA adapter {name!r} could not be numbered; try again")
    _publish(state, served, (*served.adapters, LoraAdapter(name, path, digest=digest)))
    return {"id": i, "name": f"{served.name}:{name}", "path": os.path.basename(path)}


async def _unload(
    state: ServerState, served: ServedModel, name: str, body: LoadAdapter
) -> dict[str, Any]:
    live = [i for i, a in enumerate(served.adapters) if a.name == name and not a.removed]
    if not live:
        raise NotFound(f"model {served.name!r} serves no LoRA adapter {name!r}")
    i = live[0]
    removed = dataclasses.replace(served.adapters[i], removed=True)
    _publish(state, served, (*served.adapters[:i], removed, *served.adapters[i + 1 :]))
    core = served.engine.core
    freed = await served.engine.on_engine_thread(lambda: core.release_adapter(i))
    # Freed now, or when the last request using it is done.
    return {"id": i, "name": f"{served.name}:{name}", "freed": i in freed}


def _checked(
    store: ModelStore | None, spec: ModelSpec, given: str, allowed: tuple[list[str], list[str]]
) -> tuple[str, str]:
    """The file a load may read (`loadable_path` of the `allowed` folders and files; a
    stored adapter's by its store name too), checked against its base when the store has it,
    and its digest (`file_digest`)."""
    folders, known = allowed
    manifests = store.list() if store is not None else []
    named = stored_adapter(manifests, given, "")
    if named is not None:  # by its store name: its file
        given, known = named.files[0], [*known, named.files[0]]
    path = loadable_path(given, folders, known)
    stored = named or stored_adapter(manifests, given, path)
    if stored is not None:
        check_base(stored, spec)
    return path, file_digest(path)


def _publish(state: ServerState, served: ServedModel, adapters: tuple[LoraAdapter, ...]) -> None:
    """The adapters requests may pick now, on the loaded model and for its next load."""
    served.set_adapters(adapters)
    state.models.set_adapters(served.name, adapters)
