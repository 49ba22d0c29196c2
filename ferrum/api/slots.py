"""llama-server's introspection routes, `GET /slots` and `GET /props`, in its shapes, over
every loaded chat model (llama-server's router mode takes `?model=`, and so do these).

/slots lists what each engine holds now (`ferrum.engine.slots.EngineView`): one entry per
running or waiting request, then the idle slots up to `--parallel`, with llama-server's
fields (`id`, `id_task`, `n_ctx`, `is_processing`, `params`, `next_token`) and ferrum's
(`model`, `state`, token counts). Never a prompt or an output: `prompt` is always "". A
request's id (`id_task`) is shown only to its own key (or an admin key, or on a server
without keys); another key's requests appear as lengths and states only. /slots always
needs a key when keys are set; /props, which says nothing about anyone's requests, is
public with --public-metrics (the dashboard reads it beside /metrics).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from ferrum.api.auth import Caller, caller_of
from ferrum.api.loaded import ServedModel
from ferrum.api.openai.routes import route
from ferrum.api.serving import ServerState
from ferrum.engine.slots import EngineView, SlotView, engine_view
from ferrum.errors import ServiceUnavailable
from ferrum.models.errors import ModelNotFound

_BUILD = "ferrum"


def _served(state: ServerState, model: str | None) -> list[ServedModel]:
    """The loaded chat models asked for: `model` (404 for a name the server does not know)
    or all of them."""
    spec = None if model is None else state.models.lookup(model)
    if model is not None and spec is None:
        raise ModelNotFound(model, [s.name for s in state.models.specs()])
    return [
        m.model
        for m in state.models.loaded()
        if isinstance(m.model, ServedModel) and (spec is None or m.spec.name == spec.name)
    ]


async def _view(model: ServedModel) -> EngineView | None:
    """The engine's picture, read on its thread; None when it stopped (an unload racing)."""
    engine = model.engine
    try:
        return await engine.on_engine_thread(lambda: engine_view(engine.core))
    except ServiceUnavailable:
        return None


def _slot_json(i: int, model: str, view: EngineView, slot: SlotView | None) -> Any:
    busy = slot is not None and slot.state != "waiting"
    decoded = slot.output_tokens if slot else 0
    return {
        "id": i,
        "id_task": slot.request_id if slot else None,
        "model": model,
        "n_ctx": view.n_ctx,
        "speculative": view.speculative,
        "is_processing": busy,
        "state": slot.state if slot else "idle",
        "n_prompt_tokens": slot.prompt_tokens if slot else 0,
        "n_cached_tokens": slot.cached_tokens if slot else 0,
        "n_computed_tokens": slot.computed_tokens if slot else 0,
        "prompt": "",
        "params": {
            "n_predict": slot.max_tokens if slot else -1,
            "temperature": slot.temperature if slot else None,
        },
        "next_token": {
            "has_next_token": slot is not None,
            "n_remain": slot.max_tokens - decoded if slot else -1,
            "n_decoded": decoded,
        },
    }


def _props_json(state: ServerState, model: ServedModel, view: EngineView | None) -> Any:
    info = model.info
    return {
        "model_alias": model.name,
        "model_path": model.name,  # never the file's path on the server
        "total_slots": view.max_running if view else 0,
        "build_info": _BUILD,
        "modalities": {"vision": False, "audio": False},
        "is_sleeping": False,
        "default_generation_settings": {
            "n_ctx": info.request_ctx,
            "speculative": view.speculative if view else False,
            "params": {"n_predict": model.default_max_tokens, **model.sampling},
        },
        # ferrum's own: the KV ledger the dashboard draws.
        "kv": None if view is None else {
            "block_size": view.block_size,
            "blocks_total": view.blocks_total,
            "blocks_free": view.blocks_free,
            "blocks_parked": view.blocks_parked,
        },
        "default_model": state.models.default,
    }


async def _entries(state: ServerState, model: str | None) -> list[tuple[str, Any]]:
    """(tenant, entry) of every slot of the models asked for, ids shown: running and
    waiting requests, then the idle slots up to --parallel."""
    out: list[tuple[str, Any]] = []
    for served in _served(state, model):
        view = await _view(served)
        if view is None:
            continue
        held: list[SlotView | None] = list(view.slots)
        idle = max(0, view.max_running - sum(s.state != "waiting" for s in view.slots))
        held += [None] * idle
        for i, slot in enumerate(held):
            out.append((slot.tenant if slot else "", _slot_json(i, served.name, view, slot)))
    return out


def visible(entries: list[tuple[str, Any]], caller: Caller, keys_required: bool) -> list[Any]:
    """The entries as `caller` may see them: another key's request id hidden."""
    everyone = not keys_required or caller.admin
    return [
        e if everyone or (tenant and tenant == caller.tenant) else {**e, "id_task": None}
        for tenant, e in entries
    ]


async def board_views(state: ServerState) -> dict[str, Any]:
    """What a cluster replica posts for the ingress's /props and /slots (`cluster.gather`):
    every loaded chat model's props, and every slot with its tenant (the ingress applies
    `visible` per caller; tenants never leave it)."""
    props = {}
    for served in _served(state, None):
        props[served.name] = {**_props_json(state, served, await _view(served)), "loaded": True}
    return {"default": state.models.default, "props": props, "slots": await _entries(state, None)}


def add_slots_routes(app: FastAPI, state: ServerState) -> None:
    # `route` documents the error shapes these answer (the API fuzzer checks the schema).
    @route(app, "GET", "/slots")
    async def slots(request: Request, model: str | None = None) -> list[Any]:
        entries = await _entries(state, model)
        return visible(entries, caller_of(request), state.keys.required)

    @route(app, "GET", "/props")
    async def props(model: str | None = None) -> Any:
        name = model if model is not None else state.models.default
        found = _served(state, name)
        if not found:
            spec = state.models.lookup(name)
            return {"model_alias": spec.name if spec else name, "loaded": False,
                    "build_info": _BUILD, "default_model": state.models.default}  # fmt: skip
        return {**_props_json(state, found[0], await _view(found[0])), "loaded": True}
