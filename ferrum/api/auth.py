"""Who is calling: API keys, their roles, and the tenant a request's data belongs to.

    key given        role    tenant            may
    --api-key K      user    "key:" + H(K)     generate, embed, list, tokenize, its own responses
    --admin-key K    admin   "key:" + H(K)     all that, and pull / copy / delete / load / unload
    (no keys at all) anon    ""                generate …; the store's routes only with
                                               --open-admin (a server on one person's machine)

The tenant is a digest of the key, never the key: it scopes what one key leaves behind (prefix
KV, stored responses) so that another key cannot reach it (`cache_scope`), and it is what fair
shares of decode slots are counted against. Every route reads the caller the gate stored in
the request's scope (`caller_of`); a route that changes the store asks `require_admin`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferrum.errors import AuthenticationError, PermissionDenied

log = logging.getLogger("ferrum.auth")

_SCOPE_KEY = "ferrum.caller"


@dataclass(frozen=True)
class Caller:
    """A request's sender, as the gate found it."""

    tenant: str  # "" on a server without keys: every caller is the same tenant
    admin: bool
    label: str  # for logs: which key (by its digest's start), never the key itself


ANONYMOUS = Caller(tenant="", admin=False, label="anonymous")


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


class Keys:
    """The server's keys and their roles; compares in constant time against every key, so the
    time taken does not say which key came close."""

    def __init__(
        self, user: tuple[str, ...] = (), admin: tuple[str, ...] = (), open_admin: bool = False
    ):
        self._keys = [(k.encode(), False) for k in user] + [(k.encode(), True) for k in admin]
        self.open_admin = open_admin

    @classmethod
    def from_config(
        cls, user: tuple[str, ...], admin: tuple[str, ...], keys_file: str, open_admin: bool
    ) -> Keys:
        """The flags' keys plus a keys file's (`read_keys_file`)."""
        more_user, more_admin = read_keys_file(keys_file) if keys_file else ((), ())
        return cls(user + more_user, admin + more_admin, open_admin)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    @property
    def first(self) -> str:
        """A key a component of this server may call it with (an admin key if any)."""
        ranked = sorted(self._keys, key=lambda kv: not kv[1])
        return ranked[0][0].decode() if ranked else ""

    def caller(self, headers: Mapping[str, str]) -> Caller:
        """Who sent these headers: a bearer token (OpenAI's clients) or x-api-key
        (Anthropic's). AuthenticationError when keys are required and none matches."""
        if not self._keys:
            return Caller("", True, "anonymous") if self.open_admin else ANONYMOUS
        scheme, _, bearer = headers.get("authorization", "").partition(" ")
        given = [bearer.strip() if scheme.lower() == "bearer" else None]
        given.append(headers.get("x-api-key"))
        found: tuple[bytes, bool] | None = None
        for key in given:
            if key is None:
                continue
            raw = key.encode("utf-8", "surrogateescape")
            for known, admin in self._keys:
                if hmac.compare_digest(raw, known) and found is None:
                    found = (known, admin)
        if found is None:
            raise AuthenticationError("invalid or missing API key")
        tenant = _digest(found[0].decode())
        role = "admin" if found[1] else "user"
        return Caller(f"key:{tenant}", found[1], f"{role} key {tenant[:8]}")


def read_keys_file(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A keys file: one key a line as `user KEY` or `admin KEY` (blank lines and `#` comments
    skipped). Keys in a file stay out of the process list and the shell's history."""
    user: list[str] = []
    admin: list[str] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        role, _, key = line.partition(" ")
        key = key.strip()
        if role not in ("user", "admin") or not key or " " in key:
            raise ValueError(f"{path}:{n}: expected 'user KEY' or 'admin KEY'")
        (admin if role == "admin" else user).append(key)
    if not user and not admin:
        raise ValueError(f"{path}: no keys")
    return tuple(user), tuple(admin)


def remember(scope: MutableMapping[str, Any], caller: Caller) -> None:
    """Stores the gate's finding in the ASGI scope, where `caller_of` reads it."""
    scope.setdefault("state", {})[_SCOPE_KEY] = caller


def caller_of(scope_holder: Any) -> Caller:
    """The caller the gate stored for this request (a Starlette Request, or its scope)."""
    scope = getattr(scope_holder, "scope", scope_holder)
    caller = scope.get("state", {}).get(_SCOPE_KEY)
    return caller if isinstance(caller, Caller) else ANONYMOUS


def require_admin(scope_holder: Any, action: str) -> Caller:
    """The caller, if it may change the server's models; else PermissionDenied naming why."""
    caller = caller_of(scope_holder)
    if caller.admin:
        return caller
    if caller.tenant:
        raise PermissionDenied(f"{action} needs an admin key (--admin-key); this is a user key")
    raise PermissionDenied(
        f"{action} is refused on a server without API keys; start it with --admin-key, or "
        "with --open-admin where everyone who can reach it may change its models"
    )


def cache_scope(caller: Caller, cache_salt: str | None, shared: bool) -> str:
    """Whose prefix KV a request may reuse and leaves for reuse. A request's `cache_salt`
    (vLLM's name) replaces its key's scope: callers who share a secret salt share their
    cache (wider), a salt per end user splits one key's cache (finer); the namespaces keep a
    salt from ever naming a key's scope. `shared` (--share-prefix-cache): every key's
    requests without a salt share one scope."""
    if cache_salt:
        return "salt:" + hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()
    return "" if shared else caller.tenant
