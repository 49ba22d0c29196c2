"""The pages' routes: `/`, `/dashboard` and their files under `/web/`.

Every answer carries a Content-Security-Policy that allows scripts, styles and requests only
from this server: even if a bug ever let model output into the page as HTML, an inline
script or a request elsewhere would not run."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ferrum.errors import NotFound

PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}
ASSETS = "/web/"
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def is_page(path: str) -> bool:
    """A path the gate lets through without a key: the pages and their files carry no data."""
    return path in PAGES or path.startswith(ASSETS)


def read_static() -> dict[str, bytes]:
    """The pages' files by name (read once by whoever serves them)."""
    folder = resources.files("ferrum.web").joinpath("static")
    return {
        f.name: f.read_bytes()
        for f in folder.iterdir()
        if f.is_file() and any(f.name.endswith(ext) for ext in _TYPES)
    }


def _answer(name: str, files: dict[str, bytes]) -> Response:
    body = files.get(name)
    if body is None:
        raise NotFound("no such route")
    media = next(t for ext, t in _TYPES.items() if name.endswith(ext))
    return Response(body, media_type=media, headers=_HEADERS)


def page_answer(path: str, accept: str, files: dict[str, bytes]) -> Response | None:
    """The answer to `path` for an app that routes by hand (a cluster's ingress): a page or
    a file; None for `/` asked by a client that is not a browser, which gets the API's own `/`,
    or for a path that is neither (the caller relays it)."""
    name = PAGES.get(path) or (path[len(ASSETS) :] if path.startswith(ASSETS) else None)
    if name is None or name not in files or (path == "/" and "text/html" not in accept):
        return None
    return _answer(name, files)


def _page(
    name: str, files: dict[str, bytes], plain: Callable[[], Response]
) -> Callable[[Request], Awaitable[Response]]:
    async def page(request: Request) -> Response:
        if name == PAGES["/"] and "text/html" not in request.headers.get("accept", ""):
            return plain()  # not a browser: an Ollama client probing `GET /`
        return _answer(name, files)

    return page


def add_pages(app: FastAPI, plain: Callable[[], Response]) -> None:
    """The routes of both pages and their files (read now, once: small, and never on the
    event loop). Registered before the API's own `/`: a browser (which asks for HTML) gets
    the chat, any other client `plain()`, as it did before the pages."""
    files = read_static()

    for path, name in PAGES.items():
        route = _page(name, files, plain)
        app.add_api_route(path, route, methods=["GET"], include_in_schema=False)

    async def asset(name: str) -> Response:
        return _answer(name, files)

    app.add_api_route(ASSETS + "{name}", asset, methods=["GET"], include_in_schema=False)
