"""The server's own routes, beside the dialects': /health, /metrics, /tokenize and
/detokenize."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ferrum.api.auth import caller_of
from ferrum.api.loaded import Loaded, ServedModel, context_length
from ferrum.api.openai.bodies import DetokenizeRequest, TokenizeRequest
from ferrum.api.openai.routes import route
from ferrum.api.serving import ServerState, acquire, check_token_ids, refuse_unfit_text, utf8_length
from ferrum.errors import ContextLengthExceeded
from ferrum.metrics import CONTENT_TYPE

__all__ = ["add_server_routes"]


def add_server_routes(app: FastAPI, state: ServerState) -> None:
    """The server's own routes: health, metrics and the tokenizer."""

    @route(app, "GET", "/health")
    async def health(request: Request) -> JSONResponse:
        loaded = state.models.loaded()
        ok = all(m.model.alive for m in loaded)
        if state.keys.required and not caller_of(request).tenant:
            # Liveness for anyone (a load balancer's probe); which models run, their load
            # and cache figures only for a key.
            return JSONResponse({"status": "ok" if ok else "error"}, 200 if ok else 503)
        per_model = {m.spec.name: state.metrics.snapshot(m.spec.name) for m in loaded}
        body = {
            "status": "ok" if ok else "error",
            "model": state.models.default,
            **_sum_snapshots(list(per_model.values())),
            "models": per_model,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @route(app, "GET", "/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @route(app, "POST", "/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        lease = await acquire(state, request, body.model)
        try:
            model = lease.model
            n_ctx = context_length(model)
            refuse_unfit_text(model.vocab, utf8_length(body.content), n_ctx, "content")
            tokens = await asyncio.to_thread(
                lease.model.vocab.tokenize, body.content, body.add_special, body.parse_special
            )
        finally:
            lease.release()
        return {"tokens": tokens}

    @route(app, "POST", "/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        lease = await acquire(state, request, body.model)
        try:
            model = lease.model
            n_ctx = context_length(model)
            if len(body.tokens) > n_ctx:
                # No sequence of this model is longer; joining millions of ids takes seconds.
                raise ContextLengthExceeded(
                    f"{len(body.tokens)} tokens; this model's context holds {n_ctx}",
                    param="tokens",
                )
            tokens = check_token_ids(_n_vocab(model), body.tokens, "tokens")
            data = await asyncio.to_thread(b"".join, map(model.vocab.token_bytes, tokens))
        finally:
            lease.release()
        return {"content": data.decode("utf-8", "replace")}


def _sum_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Several models' /health figures as one: counts add up, the KV use ratio is the
    highest; words (a model's KV cell types) stay with their model."""
    total: dict[str, Any] = {}
    for snap in snapshots:
        for key, value in snap.items():
            if key in ("kv_cache_types", "lora"):  # a model's own, never added up
                continue
            if isinstance(value, dict):
                total[key] = _sum_snapshots([total.get(key, {}), value])
            elif key.endswith("_ratio"):
                total[key] = max(total.get(key, 0), value)
            else:
                total[key] = total.get(key, 0) + value
    return total


def _n_vocab(model: Loaded) -> int:
    return model.info.n_vocab if isinstance(model, ServedModel) else model.embedder.info.n_vocab

