"""The cluster's /props and /slots (`ferrum.cluster.gather`, `ferrum.api.slots.visible`):
every replica's posted views merged, on fake posts (no Ray).

Oracles: every replica's entries appear once, marked with the replica that holds them and
otherwise as the replica posted them, with `ferrum serve`'s rule applied per caller (a
request's id only to its own key, an admin key, or anyone on a server without keys); /props
adds the cluster's slots and blocks up and keeps each replica's.
"""

from __future__ import annotations

from typing import Any

from ferrum.api.auth import Caller
from ferrum.api.slots import visible
from ferrum.cluster.gather import merge_props, props_answers, short_id, slot_entries

MINE, THEIRS = "tenant-mine", "tenant-theirs"


def _slot(i: int, state: str, task: str | None, model: str = "m") -> dict[str, Any]:
    return {"id": i, "id_task": task, "model": model, "state": state, "prompt": "",
            "next_token": {"n_decoded": 3, "n_remain": 5}}  # fmt: skip


def _props(slots: int, free: int, parked: int, loaded: bool = True) -> dict[str, Any]:
    kv = {"block_size": 16, "blocks_total": 100, "blocks_free": free, "blocks_parked": parked}
    return {"model_alias": "m", "total_slots": slots, "loaded": loaded, "kv": kv,
            "build_info": "ferrum", "default_model": "m"}  # fmt: skip


POSTS = {
    "app#FerrumReplica#a": {
        "default": "m",
        "props": {"m": _props(4, 60, 10)},
        "slots": [(MINE, _slot(0, "decoding", "chatcmpl-mine")), ("", _slot(1, "idle", None))],
    },
    "app#FerrumReplica#b": {
        "default": "m",
        "props": {"m": _props(2, 90, 0), "e": _props(1, 10, 0)},
        "slots": [
            (THEIRS, _slot(0, "prefill", "chatcmpl-theirs")),
            (THEIRS, _slot(0, "decoding", "chatcmpl-e", model="e")),
        ],  # fmt: skip
    },
}


def test_slots_of_every_replica_are_listed_once_each_marked_with_its_replica():
    entries = slot_entries(POSTS, "m")
    assert [(e["replica"], e["id"], e["state"]) for _, e in entries] == [
        ("a", 0, "decoding"),
        ("a", 1, "idle"),
        ("b", 0, "prefill"),
    ]
    assert len(slot_entries(POSTS, None)) == 4 and slot_entries(POSTS, "nope") == []


def test_a_key_sees_its_own_request_ids_only_an_admin_or_a_keyless_server_all():
    entries = slot_entries(POSTS, None)
    mine = visible(entries, Caller(MINE, False, "k"), keys_required=True)
    assert [e["id_task"] for e in mine] == ["chatcmpl-mine", None, None, None]
    anonymous = visible(entries, Caller("", False, "anonymous"), keys_required=True)
    assert all(e["id_task"] is None for e in anonymous)  # "" owns nothing, not idle slots
    admin = visible(entries, Caller("admin", True, "a"), keys_required=True)
    assert [e["id_task"] for e in admin] == ["chatcmpl-mine", None, "chatcmpl-theirs", "chatcmpl-e"]
    assert visible(entries, Caller("", False, "anonymous"), keys_required=False) == [
        e for _, e in entries
    ]
    assert all("tenant" not in e and e["prompt"] == "" for e in admin)


def test_props_add_up_the_cluster_and_keep_each_replicas_own():
    body = merge_props(props_answers(POSTS, None))
    assert body["loaded"] is True and body["total_slots"] == 6
    assert body["kv"] == {"block_size": 16, "blocks_total": 200, "blocks_free": 150,
                          "blocks_parked": 10}  # fmt: skip
    assert [(p["replica"], p["kv"]["blocks_free"]) for p in body["replicas"]] == [
        ("a", 60),
        ("b", 90),
    ]
    assert body["model_alias"] == "m" and "replica" not in body
    only_b = merge_props(props_answers(POSTS, "e"))
    assert only_b["total_slots"] == 1 and [p["replica"] for p in only_b["replicas"]] == ["b"]
    assert props_answers(POSTS, "nope") == []


def test_props_of_a_model_loaded_on_one_replica_only_count_that_one():
    unloaded = {"model_alias": "m", "loaded": False, "build_info": "ferrum"}
    body = merge_props([("a", unloaded), ("b", _props(4, 50, 5))])
    assert body["loaded"] is True and body["total_slots"] == 4
    assert body["kv"]["blocks_total"] == 100
    assert [p["loaded"] for p in body["replicas"]] == [False, True]
    body = merge_props([("a", unloaded)])
    assert body["loaded"] is False and "kv" not in body


def test_a_replica_is_named_by_the_last_part_of_its_ray_id():
    assert short_id("ferrum#FerrumReplica#x7k2p") == "x7k2p"
