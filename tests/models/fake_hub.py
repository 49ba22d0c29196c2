"""A local stand-in for the Hugging Face Hub, serving what huggingface_hub 2.4.0 asks for.

Routes (as `hf_api.py`, `file_download.py` and `utils/_http.py` of huggingface_hub 2.4.0 call
them):

    GET  /api/models/{repo}[/revision/{rev}][?blobs=true]   model_info (siblings, sha, gated)
    GET  /api/models/{repo}/tree/{rev}[/{path}]             list_repo_tree / list_repo_files
    HEAD /{repo}/resolve/{rev}/{path}                       file metadata
    GET  /{repo}/resolve/{rev}/{path}
    HEAD|GET /cdn/{sha256}                                  an LFS file's bytes (Range: bytes=N-)

As on the real hub, a ".gguf" file is an LFS file: its resolve answers 302 to the CDN with
`X-Linked-Etag` (its sha256), `X-Linked-Size` and `X-Repo-Commit`. The CDN address uses the
host name "localhost" while the hub is "127.0.0.1", so huggingface_hub sees another host, as
with the real CDN: it does not follow the redirect on HEAD and drops the token on GET. Other
files answer 200 with a git-sha1 `ETag`. No Xet header is ever sent, so downloads are plain
HTTP. Errors carry `X-Error-Code` (RepoNotFound, GatedRepo, RevisionNotFound, EntryNotFound),
which huggingface_hub maps onto its exception classes.

Test switches: `gated` repositories answer resolve with 401 (no token) or 403 (wrong token)
unless `Authorization: Bearer <token>`; `cut_next_download(n)` sends the next CDN body's
first n bytes and drops the connection, then (with `then_down`) answers 503 to everything
until `down` is cleared; `hold(n)` sends each CDN body's first n bytes, then waits for
`release()` before the rest (a download under way, for as long as a test needs); `corrupt`
flips the last byte of every CDN body; `log` records every request.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class LoggedRequest:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Repo:
    id: str
    folder: Path
    gated: bool = False
    files: dict[str, Path] = field(default_factory=dict)

    @functools.cached_property
    def commit(self) -> str:
        digest = hashlib.sha1()
        for name, path in sorted(self.files.items()):
            digest.update(name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()


@functools.cache
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def _git_sha1(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(name: str) -> bool:
    return name.endswith(".gguf")


class FakeHub:
    """Serves every `org/repo` folder under `root` as a model repository."""

    def __init__(self, root: Path, *, gated: set[str] = frozenset(), token: str = "hf_good"):
        self.token = token
        self.repos: dict[str, Repo] = {}
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
            repo_id = f"{folder.parent.name}/{folder.name}"
            files = {str(p.relative_to(folder)): p for p in folder.rglob("*") if p.is_file()}
            self.repos[repo_id] = Repo(repo_id, folder, repo_id in gated, files)
        self.log: list[LoggedRequest] = []
        self.down = False
        self.corrupt = False  # serve every CDN body with its last byte flipped
        self._cut: tuple[int, bool] | None = None
        self._held: int | None = None
        self._gate = threading.Event()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{port}"
        self.cdn = f"http://localhost:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def cut_next_download(self, after: int, *, then_down: bool = True) -> None:
        self._cut = (after, then_down)

    def hold(self, after: int) -> None:
        self._held = after
        self._gate.clear()

    def release(self) -> None:
        self._held = None
        self._gate.set()

    def requests(self, method: str, path_part: str) -> list[LoggedRequest]:
        with self._lock:
            return [r for r in self.log if r.method == method and path_part in r.path]

    def blob_path(self, repo_id: str, name: str) -> str:
        return f"/cdn/{_sha256(self.repos[repo_id].files[name])}"

    def take_cut(self) -> tuple[int, bool] | None:
        with self._lock:
            cut, self._cut = self._cut, None
            return cut


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        pass

    Handler.hub = hub
    return Handler


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def _route(self, method: str) -> None:
        hub = self.hub
        with hub._lock:
            hub.log.append(LoggedRequest(method, self.path, dict(self.headers.items())))
        if hub.down:
            return self._error(503, "ServiceUnavailable", "the hub is down")
        url = urlsplit(self.path)
        path = unquote(url.path)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path):
            return self._tree(m[1], m[2], m[3] or "")
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            return self._info(m[1], m[2], "blobs" in parse_qs(url.query))
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return self._resolve(method, m[1], m[2], m[3])
        if m := re.fullmatch(r"/cdn/([0-9a-f]{64})", path):
            return self._cdn(method, m[1])
        self._error(404, None, "no such route")

    # -- api -------------------------------------------------------------------------------

    def _repo(self, repo_id: str, revision: str | None) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            status = 404 if self.headers.get("Authorization") else 401
            self._error(status, "RepoNotFound", "Repository not found")
            return None
        if revision not in (None, "main", repo.commit):
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return None
        return repo

    def _info(self, repo_id: str, revision: str | None, blobs: bool) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        siblings = []
        for name, p in sorted(repo.files.items()):
            sibling: dict[str, object] = {"rfilename": name}
            if blobs:
                sibling |= {"size": p.stat().st_size, "blobId": _git_sha1(p)}
                if _is_lfs(name):
                    size = p.stat().st_size
                    sibling["lfs"] = {"size": size, "sha256": _sha256(p), "pointerSize": 134}
            siblings.append(sibling)
        info = {
            "_id": repo_id,
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": repo.commit,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": ["gguf"],
            "siblings": siblings,
        }
        self._json(info, repo.commit)

    def _tree(self, repo_id: str, revision: str, prefix: str) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        entries = []
        for name, p in sorted(repo.files.items()):
            if prefix and not name.startswith(prefix.rstrip("/") + "/"):
                continue
            entry: dict[str, object] = {
                "type": "file", "oid": _git_sha1(p), "size": p.stat().st_size, "path": name,
            }  # fmt: skip
            if _is_lfs(name):
                size = p.stat().st_size
                entry["lfs"] = {"oid": _sha256(p), "size": size, "pointerSize": 134}
            entries.append(entry)
        self._json(entries, repo.commit)

    # -- files -----------------------------------------------------------------------------

    def _resolve(self, method: str, repo_id: str, revision: str, name: str) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        if repo.gated and self.headers.get("Authorization") != f"Bearer {self.hub.token}":
            status = 403 if self.headers.get("Authorization") else 401
            message = f"Access to model {repo_id} is restricted."
            return self._error(status, "GatedRepo", message)
        path = repo.files.get(name)
        if path is None:
            return self._error(404, "EntryNotFound", "Entry not found", commit=repo.commit)
        common = {"X-Repo-Commit": repo.commit}
        if _is_lfs(name):
            sha = _sha256(path)
            self._head(
                302,
                {
                    **common,
                    "Location": f"{self.hub.cdn}/cdn/{sha}",
                    "ETag": f'"{_git_sha1(path)}"',
                    "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": str(path.stat().st_size),
                    "Content-Length": "0",
                },
            )
            return
        data = path.read_bytes()
        headers = {**common, "ETag": f'"{_git_sha1(path)}"', "Content-Length": str(len(data))}
        self._head(200, headers)
        if method == "GET":
            self.wfile.write(data)

    def _cdn(self, method: str, sha: str) -> None:
        path = next(
            (p for r in self.hub.repos.values() for p in r.files.values() if _sha256(p) == sha),
            None,
        )
        if path is None:
            return self._error(404, None, "no such blob")
        data = path.read_bytes()
        start = 0
        if m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
            start = int(m[1])
        body = data[start:]
        if self.hub.corrupt:
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        headers = {"ETag": f'"{sha}"', "Accept-Ranges": "bytes", "Content-Length": str(len(body))}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self._head(206 if start else 200, headers)
        if method != "GET":
            return
        held = self.hub._held
        if held is not None:
            self.wfile.write(body[:held])
            self.wfile.flush()
            self.hub._gate.wait(timeout=60)
            body = body[held:]
        cut = self.hub.take_cut()
        if cut is None:
            self.wfile.write(body)
            return
        after, then_down = cut
        self.wfile.write(body[:after])
        self.wfile.flush()
        if then_down:
            self.hub.down = True
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    # -- plumbing --------------------------------------------------------------------------

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()

    def _json(self, payload: object, commit: str) -> None:
        data = json.dumps(payload).encode()
        self._head(
            200,
            {"Content-Type": "application/json", "Content-Length": str(len(data)),
             "X-Repo-Commit": commit},
        )  # fmt: skip
        if self.command == "GET":
            self.wfile.write(data)

    def _error(self, status: int, code: str | None, message: str, commit: str = "") -> None:
        data = json.dumps({"error": message}).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(data))}
        if code:
            headers["X-Error-Code"] = code
        headers["X-Error-Message"] = message
        if commit:
            headers["X-Repo-Commit"] = commit
        self._head(status, headers)
        if self.command == "GET":
            self.wfile.write(data)
