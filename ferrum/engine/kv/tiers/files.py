"""The disk tier's files: one saved sequence state per file, written so a crash never leaves
a file that looks whole, read back only when everything in it checks out.

    name       <dir>/<model>/<key>.kv
    file       MAGIC | u32 header length | header (JSON) | tokens (int32 LE) | state bytes
    header     {"fingerprint", "scope", "tokens", "state_bytes", "crc32"}   crc32 of tokens + state
    key        a hash of the cache scope and the tokens (entries.state_key)

Writing goes to `.<key>.<pid>.tmp` in the same folder, is flushed and fsynced, then renamed
over the final name: a reader sees the old file, the new one, or none, never half of one.
Leftover temporary files (a crash mid-write) are removed when the folder is scanned.

A file whose header is unreadable, whose fingerprint is another model's, another llama.cpp
build's or other KV cache settings' (cell types, flash attention), or whose checksum fails is
deleted and never handed to llama.cpp. So is a file of an earlier format (`FERRUMKV1`, written
before entries had a cache scope): read as scope "" it would hand one key's prompt to every
request of a shared cache.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"FERRUMKV2\n"  # 2: the header names the entry's cache scope
SUFFIX = ".kv"
_HEADER_LEN = struct.Struct("<I")
_MAX_HEADER = 4096


class EntryError(ValueError):
    """A file that is not a whole, matching saved state: deleted, never loaded."""


@dataclass(frozen=True)
class EntryHeader:
    path: Path
    tokens: list[int]
    scope: str
    state_bytes: int
    crc32: int
    file_bytes: int


def token_bytes(tokens: list[int]) -> bytes:
    arr = array("i", tokens)
    if arr.itemsize != 4:  # pragma: no cover - every platform ferrum runs on
        raise RuntimeError("int32 token arrays need a 4-byte 'i'")
    return arr.tobytes() if _LITTLE else _swapped(arr)


_LITTLE = array("i", [1]).tobytes()[0] == 1


def _swapped(arr: array[int]) -> bytes:  # pragma: no cover - big-endian hosts
    arr.byteswap()
    return arr.tobytes()


def write_entry(
    path: Path, fingerprint: str, tokens: list[int], scope: str, state: bytes | bytearray
) -> int:
    """Writes one entry atomically; returns its size. OSError (a full disk, say) leaves no
    file behind under either name."""
    toks = token_bytes(tokens)
    crc = zlib.crc32(state, zlib.crc32(toks))
    meta = {"fingerprint": fingerprint, "scope": scope, "tokens": len(tokens)}
    header = json.dumps(meta | {"state_bytes": len(state), "crc32": crc}).encode()
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + _HEADER_LEN.pack(len(header)) + header)
            f.write(toks)
            f.write(state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(MAGIC) + _HEADER_LEN.size + len(header) + len(toks) + len(state)


def read_header(path: Path, fingerprint: str) -> EntryHeader:
    """The entry's tokens and sizes (not its state); EntryError when it is not this model's
    or not whole."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + _HEADER_LEN.size)
            if head.startswith(b"FERRUMKV") and not head.startswith(MAGIC):
                raise EntryError("an earlier ferrum's format (no cache scope)")
            if len(head) < len(MAGIC) + _HEADER_LEN.size or not head.startswith(MAGIC):
                raise EntryError("not a ferrum KV file")
            (n,) = _HEADER_LEN.unpack_from(head, len(MAGIC))
            if n > _MAX_HEADER:
                raise EntryError("header too long")
            meta = json.loads(f.read(n))
            if meta.get("fingerprint") != fingerprint:
                raise EntryError("saved by another model, llama.cpp build or KV cache settings")
            scope = meta["scope"]
            if not isinstance(scope, str):
                raise EntryError("no cache scope")
            count, state_bytes = int(meta["tokens"]), int(meta["state_bytes"])
            raw = f.read(4 * count)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EntryError(str(exc)) from exc
    expected = len(MAGIC) + _HEADER_LEN.size + n + 4 * count + state_bytes
    if len(raw) != 4 * count or size != expected:
        raise EntryError(f"{size} bytes where the header promises {expected}")
    tokens = array("i")
    tokens.frombytes(raw)
    if not _LITTLE:  # pragma: no cover
        tokens.byteswap()
    return EntryHeader(path, tokens.tolist(), scope, state_bytes, int(meta["crc32"]), size)


def read_state(header: EntryHeader) -> bytearray:
    """The entry's state bytes, checked against its checksum; EntryError otherwise."""
    state = bytearray(header.state_bytes)
    try:
        with open(header.path, "rb") as f:
            f.seek(header.file_bytes - header.state_bytes)
            got = f.readinto(state)
    except OSError as exc:
        raise EntryError(str(exc)) from exc
    crc = zlib.crc32(state, zlib.crc32(token_bytes(header.tokens)))
    if got != header.state_bytes or crc != header.crc32:
        raise EntryError("checksum mismatch: the file changed since it was written")
    return state


def scan(folder: Path, fingerprint: str) -> tuple[list[EntryHeader], list[tuple[Path, str]]]:
    """Every whole entry of this model in `folder`, and what was deleted (path, why):
    leftover temporary files and entries that do not match."""
    kept: list[EntryHeader] = []
    dropped: list[tuple[Path, str]] = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") and path.name.endswith(".tmp"):
            if _stale_tmp(path):
                path.unlink(missing_ok=True)
                dropped.append((path, "left over from a write that never finished"))
            continue
        if path.suffix != SUFFIX:
            continue
        try:
            kept.append(read_header(path, fingerprint))
        except EntryError as exc:
            path.unlink(missing_ok=True)
            dropped.append((path, str(exc)))
    return kept, dropped


def _stale_tmp(path: Path) -> bool:
    """A temporary file whose writer is gone (another live server may be writing it)."""
    try:
        pid = int(path.name.rsplit(".", 2)[-2])
    except ValueError:
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
