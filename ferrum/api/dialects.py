"""Every dialect the API speaks, and `dialect_for(path)`: the one place that decides which
dialect a path speaks (`dialect.Dialect`), for `ferrum serve`'s error handlers and gate and
for a cluster's ingress (its errors and its routing translation) alike."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from ferrum.api.anthropic.dialect import ANTHROPIC
from ferrum.api.dialect import Dialect, Translate
from ferrum.api.ollama.dialect import OLLAMA
from ferrum.api.openai.dialect import OPENAI
from ferrum.api.responses.dialect import RESPONSES
from ferrum.errors import FerrumError

__all__ = ["DIALECTS", "dialect_for", "error_response", "translation"]

# OpenAI's last: it owns every path the others do not.
DIALECTS: tuple[Dialect, ...] = (ANTHROPIC, OLLAMA, RESPONSES, OPENAI)


def dialect_for(path: str) -> Dialect:
    return next((d for d in DIALECTS[:-1] if d.owns(path)), OPENAI)


def translation(path: str) -> Translate | None:
    """How a generation path's body becomes the OpenAI body served; None: not a generation."""
    return dialect_for(path).translation(path)


def error_response(exc: FerrumError, path: str) -> JSONResponse:
    """`exc` answered in the shape of the dialect its path speaks."""
    return dialect_for(path).error_response(exc)
