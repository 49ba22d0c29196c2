"""Stored responses, for `previous_response_id` and `GET /v1/responses/{id}`: bounded in
bytes and count, least recently used first out.

Each entry keeps its response object and only its own turn of the conversation (its input
as chat messages and its output as the assistant's message), with its parent's id; a
conversation is read back by walking the parents, which touches each of them, so the
history of a conversation in use is never the first to go. A continuation whose history
has been evicted in part is refused (404) rather than answered without it.

Each entry belongs to the tenant (`ferrum.api.auth`) whose key made it: for any other key it
does not exist (the same 404 as a response never stored, so no key learns which ids exist).
When the store is full, the entry to go is the least recently used of the tenant holding the
most bytes (ties: the one whose entry is oldest), so one key storing a flood of responses
evicts its own before anyone else's; with one tenant this is plain LRU.

The store lives on the event loop: no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ferrum.api.responses.bodies import Messages, size_of
from ferrum.errors import NotFound

MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    messages: Messages  # this turn: its input, then the assistant's output
    parent: str | None
    size: int
    owner: str  # the tenant that made it


class ResponseStore:
    def __init__(self, max_bytes: int, max_entries: int = MAX_ENTRIES):
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._owner_bytes: dict[str, int] = {}
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, response: dict[str, Any], messages: Messages, parent: str | None, owner: str
    ) -> None:
        if not self.enabled:
            return
        size = size_of(response) + size_of(messages)
        entry = Stored(response, messages, parent, size, owner)
        if entry.size > self.max_bytes:
            return  # larger than the whole store: keeping it would evict everything else
        self.delete(response["id"], owner)
        self._entries[response["id"]] = entry
        self._count(entry, +1)
        while self.bytes > self.max_bytes or len(self._entries) > self.max_entries:
            self._evict_one()

    def _count(self, entry: Stored, sign: int) -> None:
        self.bytes += sign * entry.size
        held = self._owner_bytes.get(entry.owner, 0) + sign * entry.size
        if held:
            self._owner_bytes[entry.owner] = held
        else:
            self._owner_bytes.pop(entry.owner, None)

    def _evict_one(self) -> None:
        most = max(self._owner_bytes.values())
        heaviest = {o for o, n in self._owner_bytes.items() if n == most}
        rid = next(r for r, e in self._entries.items() if e.owner in heaviest)
        self._count(self._entries.pop(rid), -1)

    def get(self, response_id: str, owner: str) -> Stored:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            raise NotFound(
                f"no stored response {response_id!r}: it was never stored (store: false), "
                "was deleted, or was evicted from the store (--responses-store)",
                param="response_id",
            )
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str) -> bool:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return False
        del self._entries[response_id]
        self._count(entry, -1)
        return True

    def conversation(
        self, response_id: str, owner: str, param: str = "previous_response_id"
    ) -> Messages:
        """The chat messages of the conversation through `response_id`, oldest first."""
        turns: list[Messages] = []
        at: str | None = response_id
        seen: set[str] = set()
        while at is not None and at not in seen:
            seen.add(at)
            try:
                entry = self.get(at, owner)
            except NotFound:
                what = "" if at == response_id else f" (its history, {at!r}, was evicted)"
                raise NotFound(
                    f"{param}: no stored response {response_id!r}{what}", param=param
                ) from None
            turns.append(entry.messages)
            at = entry.parent
        return [m for turn in reversed(turns) for m in turn]
