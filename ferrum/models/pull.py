"""Pulls models from the Hugging Face Hub into the store, and adopts local GGUF files.

A pull (`pull`), step by step:
1. Asks the hub for the repository (`HfApi.model_info` with file sizes): its canonical id,
   commit and files; picks the model (`reference.choose`). The store name is
   "org/repo:QUANT", the source "hf:org/repo@<commit>".
2. Takes the name's store lock, so a second pull of the same model (another thread or
   process) waits for this one and then finds it done.
3. Returns at once when the store already has that model from the same commit.
4. Downloads each file over plain HTTP (HEAD for its metadata, GET with `http_get`) into
   `partial/<slug>/<file>.<etag>.part`. huggingface_hub's own `hf_hub_download` deletes an
   interrupted download (it writes to a per-process temporary file), so the part files are
   ours: a pull after an interrupted one asks for the missing bytes only (HTTP Range). A part
   whose etag changed on the hub is discarded.
5. Checks each file: its sha256 against the hub's (when the hub states one) and its header
   with `read_gguf` (a split model's shards must agree on their number and order).
6. Moves the files into `files/<slug>/`, then writes the manifest (`ModelStore.add`).

Room: the model's size is reserved before its first byte is fetched, against the free disk
and the store's quota (`space.py`), until its files are installed.

Failures: a hub that cannot be reached or a transfer cut short is a `PullError`; a file that
is not a whole GGUF (`InvalidModelFile`), a full disk (`InsufficientStorage`) or the quota
(`StoreQuotaExceeded`) deletes the part files. Either way no manifest is written.

Part files and cancelling: `ferrum pull` (`resume=True`, the default) keeps the part files of
a pull that failed or was interrupted (Ctrl-C), so that the next pull of the model resumes
them. The API's pulls pass `resume=False` and a `cancel` event: a server must not keep the
bytes of every pull a client gave up on, so a failed pull removes its part files, and a pull
whose client hung up (`cancel` set) stops at its next chunk (`PullCancelled`) and removes them
too. Both happen under the name's lock, so they never touch another pull's parts.

The endpoint is $HF_ENDPOINT, read at each pull; the token is `token`, else what
huggingface_hub finds itself ($HF_TOKEN, then the saved login).
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi

from ferrum.errors import NotFound
from ferrum.models.builtin import BUILTINS, builtin_path
from ferrum.models.download import (
    Progress,
    PullProgress,
    download,
    hub_errors,
    sha256_of,
)
from ferrum.models.errors import (
    InsufficientStorage,
    InvalidModelFile,
    NotOnHub,
    PullCancelled,
    PullError,
    StoreQuotaExceeded,
)
from ferrum.models.gguf_file import GGUFFacts, read_gguf
from ferrum.models.reference import (
    GGUFModel,
    Reference,
    choose,
    gguf_models,
    model_stem,
    parse_reference,
    quant_of,
    split_shards,
)
from ferrum.models.store import Manifest, ModelStore, check_name

__all__ = ["PullProgress", "adopt", "parse_reference", "pull"]


def pull(
    store: ModelStore,
    ref: str,
    *,
    progress: Progress | None = None,
    token: str | None = None,
    name: str | None = None,
    cancel: threading.Event | None = None,
    resume: bool = True,
    base: str | None = None,
) -> Manifest:
    """Pulls `ref` (see `reference.parse_reference`) into the store; a local file is adopted
    in place. `name` overrides the store name ("org/repo:QUANT"). `cancel` stops the pull at
    its next chunk; `resume=False` removes the part files of a pull that did not finish.
    `base`: the model a LoRA adapter GGUF was made for, where its metadata does not say."""
    if name is not None:
        check_name(name)  # before the hub is asked, not after the download
    if base is not None:
        check_name(base, param="base")
    if ref in BUILTINS:  # a built-in model, adopted where its package keeps it
        return adopt(store, builtin_path(ref), name or ref, source=f"builtin:{ref}")
    reference = parse_reference(ref)
    cancel = cancel or threading.Event()
    report = _cancellable(progress or (lambda p: None), cancel)
    if reference.kind == "file":
        return adopt(store, reference.path, name, base=base)
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or None
    report(PullProgress("pulling manifest"))
    plan = _plan(reference, endpoint, token)
    report(PullProgress(f"using {plan.repo}:{plan.model.quant} (available: {plan.available})"))
    name = name or f"{plan.repo}:{plan.model.quant}"
    with store.lock(name):
        manifest = _current(store, name, plan.source)
        if manifest is None:
            try:
                if cancel.is_set():  # while it waited for the lock
                    raise PullCancelled("the pull was cancelled: its client hung up")
                manifest = _fetch(store, name, plan, (endpoint, token), report, base)
            except BaseException:
                if not resume:
                    shutil.rmtree(store.partial_dir(name), ignore_errors=True)
                raise
    report(PullProgress("success"))
    return manifest


def _cancellable(report: Progress, cancel: threading.Event) -> Progress:
    """`report`, raising `PullCancelled` once `cancel` is set: a download reports each chunk
    (`download._Bar`), so it stops at its next one."""

    def check(p: PullProgress) -> None:
        if cancel.is_set():
            raise PullCancelled("the pull was cancelled: its client hung up")
        report(p)

    return check


@dataclass(frozen=True)
class _Plan:
    """What a pull fetches: a repository's model at one commit."""

    repo: str  # canonical "org/repo"
    commit: str
    model: GGUFModel
    available: str  # the repository's quantizations, for the message
    sha256: dict[str, str]  # the hub's hash of each LFS file

    @property
    def source(self) -> str:
        return f"hf:{self.repo}@{self.commit}"


def _plan(reference: Reference, endpoint: str | None, token: str | None) -> _Plan:
    with hub_errors(reference.repo, endpoint):
        info = HfApi(endpoint=endpoint).model_info(
            reference.repo, revision=reference.revision, files_metadata=True, token=token
        )
    repo, siblings = str(info.id), info.siblings or []
    models = gguf_models({s.rfilename: s.size or 0 for s in siblings})
    return _Plan(
        repo=repo,
        commit=str(info.sha),
        model=_pick(repo, models, reference.quant, reference.filename),
        available=", ".join(m.quant for m in models),
        sha256={s.rfilename: s.lfs.sha256 for s in siblings if s.lfs is not None},
    )


def _fetch(
    store: ModelStore,
    name: str,
    plan: _Plan,
    hub: tuple[str | None, str | None],
    report: Progress,
    base: str | None,
) -> Manifest:
    """Downloads, checks and installs the plan's files (the caller holds the name's lock);
    `hub`: its endpoint and token."""
    partial = store.partial_dir(name)
    endpoint, token = hub
    model = plan.model
    try:
        with store.space.reserve(name, partial, model.size):
            fetch = functools.partial(
                download, plan.repo, plan.commit, endpoint, token, partial, report
            )
            with hub_errors(plan.repo, endpoint):
                parts = [fetch(f, plan.sha256.get(f)) for f in model.files]
            facts = _check_model(parts, model.files)
            base = adapter_base(name, facts[0], base)
            return _install(store, name, (plan.source, base), model, parts, facts, report)
    except (InvalidModelFile, InsufficientStorage, StoreQuotaExceeded):
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            shutil.rmtree(partial, ignore_errors=True)
            raise InsufficientStorage(f"disk full while pulling {name}") from exc
        raise PullError(f"pulling {name} failed: {exc}") from exc


def adopt(
    store: ModelStore,
    path: str | os.PathLike[str],
    name: str | None = None,
    *,
    source: str | None = None,
    base: str | None = None,
) -> Manifest:
    """Adds a local GGUF under `name` (default: the file's stem), referenced in place: the
    store never moves or deletes it. A split model's shard brings all its shards; a LoRA
    adapter records its `base` (`adapter_base`)."""
    given = Path(path).expanduser().absolute()
    if not given.is_file():
        raise NotFound(f"no such file: {given}", param="model", code="model_not_found")
    shards = split_shards(given.name)
    files = [given.parent / s for s in shards] if shards else [given]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise InvalidModelFile(f"split model {given.name} lacks shard(s): {', '.join(missing)}")
    facts = _check_model(files, [f.name for f in files])
    name = name or model_stem(given.name)
    source = source or f"file:{files[0]}"
    base = adapter_base(name, facts[0], base)
    manifest = _manifest(name, (source, base), files, facts, quant_of(given.name))
    with store.lock(name):
        store.add(manifest)
    return manifest


def _pick(repo: str, models: list[GGUFModel], quant: str | None, file: str | None) -> GGUFModel:
    if file is None:
        return choose(repo, models, quant)
    for model in models:
        if file in model.files:
            return model
    raise NotOnHub(f"repository {repo!r} has no GGUF model file {file!r}", param="model")


def _current(store: ModelStore, name: str, source: str) -> Manifest | None:
    """The store's model `name` when it came from `source` and its files are all there."""
    try:
        manifest = store.get(name)
    except NotFound:
        return None
    whole = all(os.path.isfile(f) for f in manifest.files)
    return manifest if manifest.source == source and whole else None


def _check_model(files: Sequence[Path], names: Sequence[str]) -> list[GGUFFacts]:
    """The facts of each file; `InvalidModelFile` unless they make one whole model."""
    facts = []
    for i, (path, name) in enumerate(zip(files, names, strict=True)):
        try:
            fact = read_gguf(path)
        except InvalidModelFile as exc:
            raise InvalidModelFile(f"{name}: {exc.message.removeprefix(f'{path}: ')}") from exc
        if fact.split_count != len(files) or fact.split_no != i:
            raise InvalidModelFile(
                f"{name}: shard {fact.split_no + 1} of {fact.split_count}, expected "
                f"{i + 1} of {len(files)}"
            )
        facts.append(fact)
    return facts


def _install(
    store: ModelStore,
    name: str,
    source: tuple[str, str | None],
    model: GGUFModel,
    parts: list[Path],
    facts: list[GGUFFacts],
    report: Progress,
) -> Manifest:
    """Moves the checked files into the store, then writes their manifest."""
    report(PullProgress("writing manifest"))
    target = store.files_dir(name)
    target.mkdir(parents=True, exist_ok=True)
    files = [target / Path(f).name for f in model.files]
    for part, dest in zip(parts, files, strict=True):
        os.replace(part, dest)
    quant = model.quant if quant_of(files[0].name) else None  # else model.quant is the stem
    manifest = _manifest(name, source, files, facts, quant)
    store.add(manifest)
    shutil.rmtree(store.partial_dir(name), ignore_errors=True)
    return manifest


def _manifest(
    name: str,
    source: tuple[str, str | None],
    files: list[Path],
    facts: list[GGUFFacts],
    quant: str | None,
) -> Manifest:
    """`source`: where it came from, and a LoRA adapter's base (None: a model)."""
    first = facts[0]
    return Manifest(
        name=name,
        source=source[0],
        base=source[1],
        files=tuple(str(f) for f in files),
        size=sum(f.stat().st_size for f in files),
        sha256=sha256_of(files[0]),
        architecture=first.architecture,
        context_length=first.context_length,
        has_chat_template=first.has_chat_template,
        quant=quant or first.quant,
        added=time.time(),
    )


def adapter_base(name: str, facts: GGUFFacts, base: str | None) -> str | None:
    """A LoRA adapter's base model: `base` (`--base`), else the one its GGUF names; None for
    a model. `InvalidModelFile` for an adapter of another kind, a LoRA adapter whose base is
    unknown, or `base` given for a model."""
    if facts.adapter is None:
        if base:
            raise InvalidModelFile(f"{name} is a model, not a LoRA adapter: --base is for adapters")
        return None
    if facts.adapter != "lora":
        kind = facts.adapter or "untyped"
        raise InvalidModelFile(f"{name} is a {kind} adapter; only LoRA adapters are served")
    base = base or facts.base_model
    if not base:
        raise InvalidModelFile(
            f"{name} is a LoRA adapter whose GGUF names no base model: pull it with --base NAME "
            "(the model it was made for)"
        )
    return base
