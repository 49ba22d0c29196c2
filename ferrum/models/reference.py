"""What a `ferrum pull` argument names, and which GGUF of a repository it picks.

References (`parse_reference`):
- a local file: starts with "/", "./", "../" or "~", or is an existing file ending ".gguf"
  -> adopted in place;
- "org/repo" -> the repository's default quantization (below);
- "org/repo:QUANT" -> that quantization (case-insensitive: "q8_0" finds Q8_0);
- "org/repo/path/file.gguf" -> that file (a split model's first shard brings the others);
- each hub form may start with "hf.co/", "huggingface.co/" or "https://huggingface.co/", and
  a web address may name a revision: ".../blob/REV/file.gguf" or ".../resolve/REV/file.gguf".

A repository's models (`gguf_models`): every ".gguf" file is one model except that the shards
of a split model ("name-00001-of-00003.gguf") make one model together (it counts only with
all its shards), and vision projectors ("mmproj*") are not models. A model's quantization is
read from its file name (Q4_K_M, IQ4_XS, Q8_0, F16, BF16, ...; upper-cased).

Default pick (`choose`): Q4_K_M, then Q4_K_S, Q5_K_M, Q4_0, Q8_0, then the smallest model.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from ferrum.errors import InvalidRequest
from ferrum.models.errors import ModelNotFound, NotOnHub

PREFERRED = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q4_0", "Q8_0")

_HUB_PREFIXES = re.compile(r"^(?:https?://)?(?:www\.)?(?:hf\.co|huggingface\.co)/", re.IGNORECASE)
_NAME_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_MAX_NAME_PART = 96  # the Hub's limit on an organisation's or a repository's name
_REPO = re.compile(rf"^({_NAME_PART}/{_NAME_PART})(?::([A-Za-z0-9._-]+))?$")
_WEB_FILE = re.compile(rf"^({_NAME_PART}/{_NAME_PART})/(?:blob|resolve)/([^/]+)/(.+\.gguf)$", re.I)
_REPO_FILE = re.compile(rf"^({_NAME_PART}/{_NAME_PART})/(.+\.gguf)$", re.IGNORECASE)
_SPLIT = re.compile(r"^(?P<base>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_QUANT = re.compile(
    r"(?:^|[-_.])((?:I?Q[1-8](?:_[0-9A-Z]+)*)|BF16|F16|F32|TQ[12]_0|MXFP4(?:_MOE)?)(?=$|[-.])",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Reference:
    kind: str  # "file" (a local GGUF) or "hub"
    path: str = ""  # kind "file": absolute path
    repo: str = ""  # kind "hub": "org/repo"
    quant: str | None = None  # "org/repo:QUANT"
    filename: str | None = None  # "org/repo/path/file.gguf"
    revision: str | None = None  # from a web address; None: the default branch


@dataclass(frozen=True)
class GGUFModel:
    """One model of a repository: a single file, or all the shards of a split model."""

    quant: str  # from the file name, else the file's stem
    files: tuple[str, ...]  # repository paths; a split model's first shard first
    size: int  # bytes, 0 when the hub did not say


def parse_reference(ref: str) -> Reference:
    """What `ref` names; `InvalidRequest` when it is neither a file nor a hub reference."""
    ref = ref.strip()
    if ref.startswith(("/", "./", "../", "~")) or (ref.endswith(".gguf") and os.path.isfile(ref)):
        return Reference("file", path=os.path.abspath(os.path.expanduser(ref)))
    hub = _HUB_PREFIXES.sub("", ref).rstrip("/")
    if m := _REPO.match(hub):
        quant = m.group(2)
        return _hub(ref, repo=m.group(1), quant=quant.upper() if quant else None)
    if m := _WEB_FILE.match(hub):
        return _hub(ref, repo=m.group(1), revision=m.group(2), filename=m.group(3))
    if m := _REPO_FILE.match(hub):
        return _hub(ref, repo=m.group(1), filename=m.group(2))
    raise InvalidRequest(
        f"{ref!r} is neither a GGUF file nor a Hugging Face model "
        "(org/repo, org/repo:QUANT or org/repo/file.gguf)",
        param="model",
    )


def _hub(
    ref: str,
    repo: str,
    quant: str | None = None,
    filename: str | None = None,
    revision: str | None = None,
) -> Reference:
    """A hub reference whose names the Hub could hold: a longer one is refused here, before
    any request to it."""
    if any(len(part) > _MAX_NAME_PART for part in repo.split("/")):
        shown = ref if len(ref) <= 120 else ref[:117] + "..."
        raise InvalidRequest(
            f"{shown!r} is not a Hugging Face model: the Hub's organisation and repository "
            f"names have at most {_MAX_NAME_PART} characters",
            param="model",
        )
    return Reference("hub", repo=repo, quant=quant, filename=filename, revision=revision)


def quant_of(filename: str) -> str | None:
    """The quantization a GGUF file's name states, upper-cased ("x-q4_k_m.gguf" -> Q4_K_M)."""
    stem = _split_base(PurePosixPath(filename).name) or PurePosixPath(filename).stem
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None


def model_stem(filename: str) -> str:
    """A GGUF file's name without ".gguf" and without its shard suffix."""
    return _split_base(PurePosixPath(filename).name) or PurePosixPath(filename).stem


def split_shards(filename: str) -> list[str] | None:
    """All shard names of the split model `filename` belongs to (in order), or None."""
    m = _SPLIT.match(PurePosixPath(filename).name)
    if m is None:
        return None
    count, parent = int(m["count"]), PurePosixPath(filename).parent
    names = [f"{m['base']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    return [str(parent / n) if str(parent) != "." else n for n in names]


def gguf_models(sizes: dict[str, int]) -> list[GGUFModel]:
    """The models among a repository's files (path -> size in bytes), by path."""
    models, seen = [], set()
    for path in sorted(p for p in sizes if p.lower().endswith(".gguf")):
        if path in seen or PurePosixPath(path).name.lower().startswith("mmproj"):
            continue
        files = split_shards(path) or [path]
        if any(f not in sizes for f in files):
            continue  # a split model missing shards cannot be loaded
        seen.update(files)
        quant = quant_of(path) or model_stem(path)
        models.append(GGUFModel(quant, tuple(files), sum(sizes[f] for f in files)))
    return models


def choose(repo: str, models: list[GGUFModel], quant: str | None) -> GGUFModel:
    """The model `quant` names (case-insensitive), else the default pick."""
    if not models:
        raise NotOnHub(f"repository {repo!r} has no GGUF model", param="model")
    if quant is not None:
        for model in models:
            if model.quant.upper() == quant.upper():
                return model
        raise ModelNotFound(f"{repo}:{quant}", [f"{repo}:{m.quant}" for m in models])
    for preferred in PREFERRED:
        for model in models:
            if model.quant == preferred:
                return model
    return min(models, key=lambda m: (m.size, m.quant))


def _split_base(name: str) -> str | None:
    m = _SPLIT.match(name)
    return m["base"] if m else None
