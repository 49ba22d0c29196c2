"""Fetching a model's files from the Hugging Face Hub for `pull`: one file into its part file
over plain HTTP (resuming what an interrupted pull left, HTTP Range), its progress as
Ollama's /api/pull reports it, its sha256, and the hub's errors as ferrum's (the room a model
needs: `space.py`)."""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get

# Public, but exported lazily, which mypy cannot see.
from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

from ferrum.models.errors import (
    HubAccessDenied,
    InvalidModelFile,
    NotOnHub,
    PullError,
)

_HASH_CHUNK = 2**20


@dataclass(frozen=True)
class PullProgress:
    """One step of a pull, as Ollama's /api/pull streams them: "pulling manifest",
    "using ...", "pulling FILE" (with byte counts, repeated), "verifying FILE",
    "writing manifest", "success"."""

    status: str
    completed: int = 0  # bytes of `file` on disk
    total: int = 0  # bytes of `file`; 0 when unknown
    file: str = ""


Progress = Callable[[PullProgress], None]


def download(
    repo: str,
    commit: str,
    endpoint: str | None,
    token: str | None,
    partial: Path,
    report: Progress,
    file: str,
    sha256: str | None,
) -> Path:
    """Downloads one file into its part file, resuming what an earlier pull left."""
    url = hf_hub_url(repo, file, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)
    etag = (meta.etag or "noetag").replace("/", "_")
    base = Path(file).name
    partial.mkdir(parents=True, exist_ok=True)
    part = partial / f"{base}.{etag}.part"
    for stale in partial.glob(f"{glob.escape(base)}.*.part"):
        if stale != part:  # the hub's file changed since: its bytes cannot be resumed
            stale.unlink()
    done = part.stat().st_size if part.exists() else 0
    if meta.size is not None and done > meta.size:
        part.unlink()
        done = 0
    headers = build_hf_headers(token=token)
    if urlsplit(meta.location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a signed CDN address: the token stays on the hub
    on_bytes = functools.partial(_report_bytes, report, base)
    part.touch()
    with open(part, "r+b") as f:
        f.seek(done)
        http_get(
            meta.location,
            f,
            resume_size=done,
            headers=headers,
            expected_size=meta.size,
            displayed_filename=base,
            tqdm_class=cast(Any, functools.partial(_Bar, on_bytes)),
        )
    size = part.stat().st_size
    on_bytes(size, meta.size or size)
    if sha256 is None and len(meta.etag or "") == 64:
        sha256 = meta.etag  # an LFS file's etag is its sha256
    if sha256 is not None:
        report(PullProgress(f"verifying {base}", size, size, base))
        if sha256_of(part) != sha256.lower():
            part.unlink()
            raise InvalidModelFile(f"{repo}/{file}: sha256 differs from the hub's")
    return part


def _report_bytes(report: Progress, base: str, completed: int, total: int) -> None:
    report(PullProgress(f"pulling {base}", completed, total, base))


class _Bar:
    """Stands in for huggingface_hub's tqdm bar in `http_get`: forwards byte counts."""

    def __init__(self, on_bytes: Callable[[int, int], None], **kwargs: Any):
        self.on_bytes = on_bytes
        self.n = int(kwargs.get("initial") or 0)
        self.total = int(kwargs.get("total") or 0)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: float | None = 1) -> None:
        self.n += int(n or 0)
        self.on_bytes(self.n, self.total)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def hub_errors(repo: str, endpoint: str | None) -> Iterator[None]:
    """Turns huggingface_hub's errors into ferrum's, each with a one-line message."""
    hub = endpoint or "https://huggingface.co"
    try:
        yield
    except GatedRepoError as exc:
        raise HubAccessDenied(
            f"{repo} is gated: accept its terms on the hub, then set HF_TOKEN to a token "
            "of an account that has access"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise NotOnHub(
            f"repository {repo!r} not found on {hub} (a private one needs HF_TOKEN)",
            param="model",
        ) from exc
    except RevisionNotFoundError as exc:
        raise NotOnHub(f"repository {repo!r} has no such revision", param="model") from exc
    except EntryNotFoundError as exc:
        raise NotOnHub(f"a file of {repo!r} vanished from the hub", param="model") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        if status in (401, 403):
            raise HubAccessDenied(f"{hub} refused access to {repo} ({status})") from exc
        raise PullError(f"{hub} answered {status} for {repo}; try again later") from exc
    except (httpx2.HTTPError, OfflineModeIsEnabled) as exc:
        raise PullError(f"cannot reach {hub}: {type(exc).__name__}: {exc}") from exc
