"""`ferrum pull|list|show|rm|cp|ps`: the model store from the command line.

Each command takes `--models-dir` (default: `default_models_dir()`); `ps` asks a running
server instead (`GET /api/ps`). Tables go to stdout, progress to stderr. A failure prints one
line, `ferrum: error: ...`, to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from ferrum.errors import FerrumError
from ferrum.models.builtin import refuse_builtin_name
from ferrum.models.pull import PullProgress, pull
from ferrum.models.store import Manifest, ModelStore, default_models_dir
from ferrum.models.store_adapters import listed_name

_FOREVER_S = 50 * 365 * 86400.0  # Ollama shows keep_alive -1 as a far-future expiry


def add_parsers(subparsers: Any) -> None:
    """Adds the model commands to a parser's subparsers."""
    p = _add(subparsers, "pull", _pull, "download a GGUF model from the Hugging Face Hub")
    p.add_argument("ref", help="org/repo, org/repo:QUANT, org/repo/file.gguf or ./file.gguf")
    p.add_argument("--name", help="store it under this name (default: org/repo:QUANT)")
    p.add_argument("--base", help="a LoRA adapter's base model, where its GGUF does not name it")
    _add(subparsers, "list", _list, "list the models in the store", aliases=["ls"])
    p = _add(subparsers, "show", _show, "show a model's facts")
    p.add_argument("name")
    p = _add(subparsers, "rm", _rm, "remove models from the store")
    p.add_argument("names", nargs="+", metavar="NAME")
    p = _add(subparsers, "cp", _cp, "copy a model under another name")
    p.add_argument("src")
    p.add_argument("dst")
    p = subparsers.add_parser("ps", help="list the models a running server has loaded")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server's address")
    p.set_defaults(models_handler=_ps)


def run(args: argparse.Namespace) -> int:
    """Runs the command `args` names; the process exit code."""
    try:
        code: int = args.models_handler(args)
        return code
    except (FerrumError, ValueError, OSError) as exc:
        print(f"ferrum: error: {getattr(exc, 'message', None) or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ferrum: interrupted (a pull resumes where it stopped)", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ferrum")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    sys.exit(run(parser.parse_args(argv)))


def _add(
    subparsers: Any, name: str, handler: Callable[[argparse.Namespace], int], help: str, **kw: Any
) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(name, help=help, **kw)
    p.add_argument("--models-dir", default=None, help="the model store (default: %(default)s)")
    p.set_defaults(models_handler=handler)
    return p


def _store(args: argparse.Namespace) -> ModelStore:
    return ModelStore(args.models_dir or default_models_dir())


def _pull(args: argparse.Namespace) -> int:
    if args.name and args.name.lower() != args.ref.lower():  # a built-in under its own name
        refuse_builtin_name(args.name, "pulled over")
    bar = _ProgressBar()
    try:
        m = pull(_store(args), args.ref, progress=bar, name=args.name, base=args.base)
    finally:
        bar.close()
    print(f"pulled {m.name} ({_size(m.size)})")
    return 0


def _list(args: argparse.Namespace) -> int:
    # A LoRA adapter is listed as served, `BASE:ADAPTER`, with the name to `rm` it by.
    models = _store(args).list()
    adapters = any(m.base is not None for m in models)
    rows = [
        [listed_name(m), m.sha256[:12], _size(m.size),
         time.strftime("%Y-%m-%d %H:%M", _local(m.added)),
         *([m.name if m.base is not None else ""] if adapters else [])]
        for m in models
    ]  # fmt: skip
    _table(["NAME", "ID", "SIZE", "ADDED", *(["STORED AS"] if adapters else [])], rows)
    return 0


def _show(args: argparse.Namespace) -> int:
    m = _store(args).resolve(args.name)
    facts = [
        ("name", m.name),
        *([("LoRA adapter of", m.base)] if m.base is not None else []),
        ("source", m.source),
        ("architecture", m.architecture or "-"),
        ("context length", str(m.context_length or "-")),
        ("quantization", m.quant or "-"),
        ("chat template", "yes" if m.has_chat_template else "no"),
        ("size", _size(m.size)),
        ("sha256", m.sha256),
        *(("file" if i == 0 else "", f) for i, f in enumerate(m.files)),
    ]
    for key, value in facts:
        print(f"  {key:<16}{value}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    store = _store(args)
    for name in args.names:
        print(f"deleted {store.remove(name).name}")
    return 0


def _cp(args: argparse.Namespace) -> int:
    refuse_builtin_name(args.dst, "copied over")
    store = _store(args)
    m: Manifest = store.copy(args.src, args.dst)
    print(f"copied {args.src} to {m.name}")
    return 0


def _ps(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/") + "/api/ps"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
    except (urllib.error.URLError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OSError(f"cannot reach the server at {args.url}: {reason}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{url} did not answer JSON") from exc
    rows = [
        [
            str(m.get("name", "")),
            _size(int(m.get("size") or 0)),
            _kv(m.get("kv_cache")),
            _until(m.get("expires_at")),
        ]
        for m in body.get("models", [])
    ]
    _table(["NAME", "SIZE", "KV", "UNTIL"], rows)
    return 0


def _kv(cache: Any) -> str:
    """A loaded model's KV cell types, K/V ("-": not a chat model, or an older server)."""
    if not isinstance(cache, dict):
        return "-"
    return f"{cache.get('type_k', '?')}/{cache.get('type_v', '?')}"


class _ProgressBar:
    """Shows a pull's progress on stderr: a bar per file, a line per other step."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.file = ""

    def __call__(self, p: PullProgress) -> None:
        if not p.file or not p.status.startswith("pulling"):
            self.close()
            print(p.status, file=sys.stderr)
            return
        if p.file != self.file:
            from tqdm import tqdm  # a dependency of huggingface_hub

            self.close()
            self.file = p.file
            self.bar = tqdm(
                desc=f"pulling {p.file}", total=p.total or None, unit="B", unit_scale=True,
                file=sys.stderr, leave=True,
            )  # fmt: skip
        if p.total and self.bar.total != p.total:
            self.bar.total = p.total
        self.bar.update(p.completed - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.file = None, ""


def _local(t: float) -> time.struct_time:
    return time.localtime(t)


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _size(n: int) -> str:
    """Bytes as Ollama shows them (decimal units): 4.7 GB, 215 KB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{n} B"


def _until(expires_at: object) -> str:
    """An RFC 3339 expiry as "in 4 minutes"; "-" while a model is busy (no expiry)."""
    if not isinstance(expires_at, str) or not expires_at:
        return "-"
    # Go writes nanoseconds; Python reads up to microseconds.
    text = re.sub(r"(\.\d{6})\d+", r"\1", expires_at.replace("Z", "+00:00"))
    try:
        left = datetime.fromisoformat(text).timestamp() - time.time()
    except ValueError:
        return expires_at
    if left > _FOREVER_S:
        return "forever"
    if left <= 0:
        return "now"
    for unit, scale in (("hour", 3600), ("minute", 60), ("second", 1)):
        if left >= scale:
            n = int(left // scale)
            return f"in {n} {unit}{'s' if n != 1 else ''}"
    return "now"


if __name__ == "__main__":
    main()
