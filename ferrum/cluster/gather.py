"""The dashboard's data behind `ferrum cluster`: `/props` and `/slots` of every replica,
merged into one answer, each entry marked with the `replica` that holds it.

Each replica posts, every stats period and beside its /metrics, what its own /props and
/slots would say (`ferrum.api.slots.board_views`): every loaded chat model's props, and every
slot with the tenant (key digest) that owns it. The ingress answers from those posts and
applies `ferrum serve`'s rule per caller (`ferrum.api.slots.visible`): a request's id only to
its own key (or an admin key, or on a server without keys), never text. Tenants never leave
the ingress. The posts are as old as one stats period at most.

    /slots  every replica's entries, one list, in the replicas' order
    /props  llama-server's object (the first replica's, with the cluster's slots and KV
            blocks added up) and `replicas`: each replica's own answer

Pure functions over the posts, so that they can be tested without Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_SUMMED_KV = ("blocks_total", "blocks_free", "blocks_parked")

Views = Mapping[str, Any]  # one replica's post: {"default", "props": {model: …}, "slots"}


def short_id(replica_id: str) -> str:
    """A replica's name in the cluster's answers: the last part of Ray's full replica id."""
    return replica_id.rsplit("#", 1)[-1]


def slot_entries(posts: Mapping[str, Views], model: str | None) -> list[tuple[str, Any]]:
    """(tenant, entry) of every replica's slots (of `model`, or all), each entry marked with
    its replica's short name; the caller's rule is applied after (`api.slots.visible`)."""
    out = []
    for replica, views in posts.items():
        for tenant, entry in views.get("slots", ()):
            if isinstance(entry, dict) and (model is None or entry.get("model") == model):
                out.append((str(tenant), {**entry, "replica": short_id(replica)}))
    return out


def props_answers(posts: Mapping[str, Views], model: str | None) -> list[tuple[str, Any]]:
    """(replica, props) of the replicas that hold `model` (None: each one's default)."""
    out = []
    for replica, views in posts.items():
        name = model if model is not None else views.get("default")
        props = views.get("props", {}).get(name)
        if isinstance(props, dict):
            out.append((short_id(replica), props))
    return out


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
