"""The dashboard's data behind `ferrum cluster`: `/props` and `/slots` asked of every replica
and merged into one answer, each entry marked with the `replica` that gave it.

Each replica answers the caller's own request (its key, its query), so the rules of
`ferrum serve` hold unchanged: /slots needs a key and shows a request's id only to its own
key, never text (`ferrum.api.slots`); the merge adds a replica's name and nothing else.

    /slots  every replica's entries, one list, in the replicas' order
    /props  llama-server's object (the first replica's, with the cluster's slots and KV
            blocks added up) and `replicas`: each replica's own answer

Pure functions over the answers, so that they can be tested without Ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_SUMMED_KV = ("blocks_total", "blocks_free", "blocks_parked")


@dataclass(frozen=True)
class Answer:
    """One replica's answer to a gathered route."""

    replica: str  # the short name the /metrics `replica` label uses
    status: int
    body: bytes


def short_id(replica_id: str) -> str:
    """A replica's name in the cluster's answers: the last part of Ray's full replica id."""
    return replica_id.rsplit("#", 1)[-1]


def merge(path: str, answers: list[Answer]) -> tuple[int, Any] | None:
    """The cluster's answer (status, JSON body) to a gathered route; None when no replica
    gave one (the caller answers 503). A refusal (a 4xx: no key, an unknown model) is the
    same from every replica, which share their settings: the first is passed on whole."""
    seen: set[str] = set()
    ok: list[tuple[str, Any]] = []
    refused: tuple[int, Any] | None = None
    for a in answers:
        if a.replica in seen:  # a pin to a replica gone was routed to one already asked
            continue
        seen.add(a.replica)
        try:
            body = json.loads(a.body)
        except ValueError:
            continue  # a replica cut short: left out, as one that did not answer
        if a.status == 200:
            ok.append((a.replica, body))
        elif 400 <= a.status < 500 and refused is None:
            refused = (a.status, body)
    if not ok:
        return refused
    if path == "/slots":
        return 200, merge_slots(ok)
    return 200, merge_props(ok)


def merge_slots(answers: list[tuple[str, Any]]) -> list[Any]:
    return [
        {**entry, "replica": replica}
        for replica, entries in answers
        if isinstance(entries, list)
        for entry in entries
        if isinstance(entry, dict)
    ]


def merge_props(answers: list[tuple[str, Any]]) -> dict[str, Any]:
    each = [{**props, "replica": r} for r, props in answers if isinstance(props, dict)]
    if not each:
        return {"replicas": []}
    loaded = [p for p in each if p.get("loaded")]
    out = {k: v for k, v in (loaded or each)[0].items() if k != "replica"}
    out["loaded"] = bool(loaded)
    if loaded:
        out["total_slots"] = sum(int(p.get("total_slots") or 0) for p in loaded)
        kvs = [p["kv"] for p in loaded if isinstance(p.get("kv"), dict)]
        if kvs:
            summed = {k: sum(int(kv.get(k) or 0) for kv in kvs) for k in _SUMMED_KV}
            out["kv"] = {**kvs[0], **summed}
    out["replicas"] = each
    return out
