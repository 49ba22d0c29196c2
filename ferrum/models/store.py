"""The on-disk model store: named models, each a manifest and the GGUF files it lists.

Layout (root: `default_models_dir()` unless given):

    root/manifests/<slug>.json     one per model: a `Manifest` (the name is inside)
    root/files/<slug>/<file>.gguf  the model's files, when the store owns them
    root/partial/<slug>/           an unfinished pull, kept so the next pull resumes it
    root/locks/<slug>.lock         the per-name lock (never deleted: waiters hold it open)

<slug> is the name lower-cased and percent-encoded (`quote`, dots too), so "Org/Repo:Q4_K_M"
and "org/repo:q4_k_m" are one model: names are unique regardless of case.

Rules:
- A manifest is written to a temporary file, fsynced and renamed over the old one
  (`os.replace`), so a crash leaves either the old or the new manifest, never half of one.
- Files come before their manifest: a pull moves its files into `files/<slug>/` and then
  writes the manifest; removal deletes the manifest first and then the files. A crash in
  between leaves a files directory without a manifest, which the next open deletes.
- The store deletes only what lies under `root/files/`. A manifest may list files outside it
  (an adopted file, a built-in model's): those are referenced in place and never deleted.
- `copy` hard-links the files into the new model's own directory (a plain copy where links
  are refused, which counts against the quota: `space.py`), so removing either model leaves
  the other whole.
- Pulls and removals of one name hold its lock (`lock`, a `filelock.FileLock`, so it works
  across processes): a second one waits up to `lock_timeout` seconds, then gets `ModelBusy`.
  `add` does not lock: a caller that races with others on a name holds `lock(name)`.
- Opening the store cleans up: files directories without a manifest (unless their name is
  locked: a pull is moving them in) and temporary manifests older than a minute.
- A manifest that does not parse is skipped with a warning, never a crash.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import filelock

from ferrum.errors import InvalidRequest
from ferrum.models.errors import ModelBusy, ModelNotFound
from ferrum.models.space import StoreSpace

log = logging.getLogger("ferrum.models")

_MANIFEST_VERSION = 1
_STALE_TMP_S = 60.0
_MAX_NAME = 200
# A slug is a file name's stem, and file names are limited to 255 bytes: the longest the
# store makes is a temporary manifest, ".<slug>.<8 hex>.tmp".
_MAX_SLUG = 255 - len("..12345678.tmp")


def default_models_dir() -> Path:
    """$FERRUM_MODELS_DIR, else $XDG_CACHE_HOME/ferrum/models, else ~/.cache/ferrum/models."""
    if env := os.environ.get("FERRUM_MODELS_DIR"):
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "ferrum" / "models"


@dataclass(frozen=True)
class Manifest:
    name: str
    source: str  # "hf:org/repo@<commit>", "file:/abs/path", "builtin:<name>", "copy:<name>"
    files: tuple[str, ...]  # absolute paths; files[0] is what llama.cpp loads (first shard)
    size: int  # bytes, all files
    sha256: str  # of files[0]: a split model's first shard (which holds its metadata)
    architecture: str
    context_length: int | None
    has_chat_template: bool
    quant: str | None
    added: float  # unix time
    # A LoRA adapter's base model (what `ferrum pull --base` or the GGUF's metadata named);
    # None: a model. An adapter is served on its base (`store_adapters.py`), never alone.
    base: str | None = None

    def to_json(self) -> str:
        return json.dumps({"version": _MANIFEST_VERSION, **asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """A manifest from its JSON; ValueError when any field is missing or mistyped."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != _MANIFEST_VERSION:
            raise ValueError("not a version 1 manifest")
        files = data.get("files")
        if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
            raise ValueError("files must be a non-empty list of paths")
        fields: dict[str, Any] = {"files": tuple(files)}
        for key, types in _FIELD_TYPES.items():
            value = data.get(key)
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise ValueError(f"field {key!r} is missing or mistyped")
            fields[key] = value
        base = data.get("base")  # absent in manifests written before adapters were pulled
        if base is not None and not isinstance(base, str):
            raise ValueError("field 'base' is mistyped")
        return cls(**fields, base=base)


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "source": (str,), "size": (int,), "sha256": (str,),
    "architecture": (str,), "context_length": (int, type(None)), "has_chat_template": (bool,),
    "quant": (str, type(None)), "added": (float, int),
}  # fmt: skip


def slug(name: str) -> str:
    """The file-safe form of a model name (case-folded, so names are unique regardless of
    case); validates the name."""
    check_name(name)
    return _quoted(name)


def check_name(name: str, param: str = "model") -> None:
    """The one rule for a store name (every pull, copy and removal goes through it): 1 to
    200 printable characters, no blanks around them, and short enough to make a file name
    once percent-encoded (a "/" takes 3 bytes, a non-ASCII letter up to 12)."""
    shown = repr(name) if len(name) <= 60 else repr(name[:57]) + "..."
    if not name or not name.isprintable() or name != name.strip():
        raise InvalidRequest(
            f"{param} {shown} is not a valid model name: it must be printable characters, "
            "without blanks around them",
            param=param,
        )
    if len(name) > _MAX_NAME or len(_quoted(name)) > _MAX_SLUG:
        raise InvalidRequest(
            f"{param} {shown} is too long for a model name ({len(name)} characters): at most "
            f"{_MAX_NAME}, and fewer with many characters other than letters, digits, - and _",
            param=param,
        )


def _quoted(name: str) -> str:
    return quote(name.lower(), safe="").replace(".", "%2E")


class ModelStore:
    def __init__(
        self, root: str | os.PathLike[str], *, lock_timeout: float = 30.0, max_bytes: int = 0
    ):
        self.root = Path(root).expanduser().absolute()
        self.lock_timeout = lock_timeout
        self.manifests = self.root / "manifests"
        self.files = self.root / "files"
        self.partial = self.root / "partial"
        self.locks = self.root / "locks"
        for d in (self.manifests, self.files, self.partial, self.locks):
            d.mkdir(parents=True, exist_ok=True)
        self.space = StoreSpace(self.root, self.files, self.partial, max_bytes)
        self._clean_orphans()

    # -- reading ----------------------------------------------------------------------------

    def list(self) -> list[Manifest]:
        """Every model, by name; manifests that do not parse are skipped with a warning."""
        found = (self._read(p) for p in self.manifests.glob("*.json"))
        return sorted((m for m in found if m is not None), key=lambda m: m.name.lower())

    def get(self, name: str) -> Manifest:
        """The model named `name` (case-insensitive)."""
        manifest = self._read(self._manifest_path(name))
        if manifest is None:
            raise ModelNotFound(name, [m.name for m in self.list()])
        return manifest

    def resolve(self, name: str) -> Manifest:
        """The model a user means by `name`: the name itself (case-insensitive), the name
        without a trailing ":latest", or "org/repo" when exactly one "org/repo:*" exists."""
        models = self.list()
        wanted = name.lower()
        for candidate in (wanted, wanted.removesuffix(":latest")):
            for m in models:
                if m.name.lower() == candidate:
                    return m
        if ":" not in wanted:
            tagged = [m for m in models if m.name.lower().partition(":")[0] == wanted]
            if len(tagged) == 1:
                return tagged[0]
            if tagged:
                raise ModelNotFound(name, [m.name for m in tagged])
        raise ModelNotFound(name, [m.name for m in models])

    def files_dir(self, name: str) -> Path:
        """Where the store keeps the files of the model `name`."""
        return self.files / slug(name)

    def partial_dir(self, name: str) -> Path:
        """Where an unfinished pull of `name` keeps its data until it completes."""
        return self.partial / slug(name)

    # -- writing ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Holds the name's lock (across processes); `ModelBusy` after `lock_timeout` s."""
        lock = filelock.FileLock(str(self.locks / f"{slug(name)}.lock"))
        try:
            lock.acquire(timeout=self.lock_timeout)
        except filelock.Timeout as exc:
            raise ModelBusy(
                f"model {name!r} is busy: another pull or removal of it is running"
            ) from exc
        try:
            yield
        finally:
            lock.release()

    def add(self, manifest: Manifest) -> None:
        """Writes the manifest atomically (replacing one of the same name), then deletes the
        files in the model's directory that it no longer lists (an older pull's)."""
        path = self._manifest_path(manifest.name)
        tmp = self.manifests / f".{path.stem}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(manifest.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.manifests)
        own = self.files_dir(manifest.name)
        if own.is_dir():
            kept = {Path(f) for f in manifest.files}
            for old in own.iterdir():
                if old not in kept:
                    _delete(old)

    def remove(self, name: str) -> Manifest:
        """Removes a model (found as `resolve` finds it): its manifest, then the files the
        store owns, and any unfinished pull of it. Returns what was removed."""
        manifest = self.resolve(name)
        with self.lock(manifest.name):
            self._manifest_path(manifest.name).unlink(missing_ok=True)
            _fsync_dir(self.manifests)
            _delete(self.files_dir(manifest.name))
            _delete(self.partial_dir(manifest.name))
        return manifest

    def copy(self, src: str, dst: str) -> Manifest:
        """A new model `dst` with the files of `src` (hard links of the store's files; files
        outside the store referenced in place). An existing `dst` is replaced."""
        check_name(dst, param="destination")
        source = self.resolve(src)
        if slug(dst) == slug(source.name):
            raise InvalidRequest(f"cannot copy {source.name!r} onto itself", param="model")
        with self.lock(dst):
            target = self.files_dir(dst)
            files = [self._link_into(Path(f), target) for f in source.files]
            manifest = Manifest(
                **{
                    **asdict(source),
                    "name": dst,
                    "source": f"copy:{source.name}",
                    "files": tuple(files),
                    "added": time.time(),
                }
            )
            self.add(manifest)
        return manifest

    # -- internals --------------------------------------------------------------------------

    def _manifest_path(self, name: str) -> Path:
        return self.manifests / f"{slug(name)}.json"

    def _read(self, path: Path) -> Manifest | None:
        try:
            return Manifest.from_json(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as exc:
            log.warning("ignoring the unreadable model manifest %s: %s", path, exc)
            return None

    def _link_into(self, file: Path, target: Path) -> str:
        if not file.is_relative_to(self.files):
            return str(file)
        target.mkdir(parents=True, exist_ok=True)
        dest = target / file.name
        dest.unlink(missing_ok=True)  # an older model of this name: `add` prunes the rest
        try:
            os.link(file, dest)
        except OSError:  # a filesystem without hard links: a real copy takes room
            with self.space.reserve(f"a copy of {file.name}", None, file.stat().st_size):
                shutil.copy2(file, dest)
        return str(dest)

    def _clean_orphans(self) -> None:
        now = time.time()
        for tmp in self.manifests.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > _STALE_TMP_S:
                    tmp.unlink()
        for d in self.files.iterdir():
            if (self.manifests / f"{d.name}.json").exists():
                continue
            lock = filelock.FileLock(str(self.locks / f"{d.name}.lock"))
            try:
                lock.acquire(timeout=0)
            except filelock.Timeout:
                continue  # a pull is moving its files in; its manifest comes next
            try:
                if not (self.manifests / f"{d.name}.json").exists():
                    log.info("removing model files without a manifest: %s", d)
                    _delete(d)
            finally:
                lock.release()


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    # Makes a rename or unlink durable; some filesystems cannot open a directory for this.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
