"""Request bodies whose text is not valid Unicode, refused where every body enters.

JSON may escape a lone UTF-16 surrogate (`"\\ud800"`), and Python's `json` (as pydantic's
parser) takes it into a `str`, which then fails much later, wherever the text is encoded
as UTF-8: the tokenizer, the chat template, a log line. Every dialect's text (OpenAI's,
the Responses API's, Ollama's, Anthropic's, embeddings, rerank, /tokenize) would need its
own check, so one ASGI middleware (`SurrogateCheck`) looks at every JSON body before its
route parses it, and answers a 400 naming the parameter as the client wrote it.

Cost: a body is scanned for the escape (`\\uD8`..`\\uDF`) as bytes; only a body that has
one is parsed here (a pair that makes a real character is such an escape too).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from ferrum.errors import FerrumError, InvalidRequest

__all__ = ["SurrogateCheck", "lone_surrogate"]

_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

Respond = Callable[[FerrumError, str], JSONResponse]


def lone_surrogate(raw: bytes) -> InvalidRequest | None:
    """The 400 for a JSON body with a lone surrogate in a string (or a key), naming where;
    None for any other body (one that is not JSON is its route's to refuse)."""
    if not _ESCAPE.search(raw):
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    found = _find(value)
    if found is None:
        return None
    param, char = found
    where = param or "the request body"
    return InvalidRequest(
        f"{where} contains a lone surrogate (U+{ord(char):04X}), which is not valid Unicode",
        param=param or None,
    )


def _find(value: Any) -> tuple[str, str] | None:
    """The path (`messages[0].content`) and character of the first lone surrogate. A
    pair that escapes one character was joined by the parser: any surrogate left is lone.
    Iterative: a deeply nested body must not exhaust the stack."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, str):
            if m := _SURROGATE.search(item):
                return path, m.group()
        elif isinstance(item, dict):
            for key, sub in reversed(item.items()):
                inner = f"{path}.{key}" if path else key
                if m := _SURROGATE.search(key):
                    return path, m.group()
                todo.append((inner, sub))
        elif isinstance(item, list):
            todo.extend((f"{path}[{i}]", sub) for i, sub in reversed(list(enumerate(item))))
    return None


class SurrogateCheck:
    """Reads a request's body, refuses it (`respond`: in its path's error shape) when it holds
    a lone surrogate, and otherwise hands the route the same body. After the body, `receive`
    is the server's own, so disconnects reach the route as before."""

    def __init__(self, app: Any, respond: Respond):
        self.app = app
        self.respond = respond

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in _METHODS:
            await self.app(scope, receive, send)
            return
        chunks, message = [], {"type": "http.request", "more_body": True}
        while message["type"] == "http.request" and message.get("more_body", False):
            message = await receive()
            chunks.append(message.get("body", b""))
        if message["type"] != "http.request":  # gone before its body came: the route sees it
            await self.app(scope, _replay(message, receive), send)
            return
        body = b"".join(chunks)
        if (err := lone_surrogate(body)) is not None:
            await self.respond(err, scope["path"])(scope, receive, send)
            return
        await self.app(scope, _replay({"type": "http.request", "body": body}, receive), send)


def _replay(first: dict[str, Any], receive: Any) -> Any:
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return first

    return replay
