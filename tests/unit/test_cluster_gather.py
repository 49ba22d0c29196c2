"""The cluster's /props and /slots (`ferrum.cluster.gather`): every replica's answer to the
caller's own request, merged, on fake replica answers (no Ray).

Oracles: every replica's entries appear once, marked with the replica that gave them and
otherwise as the replica gave them (its key rules hold: the merge adds no id); a refusal
passes through in the route's shape; a replica that failed is left out, and none at all is
no answer; /props adds the cluster's slots and blocks up and keeps each replica's.
"""

from __future__ import annotations

import json
from typing import Any

from ferrum.cluster.gather import Answer, merge, short_id


def _slot(i: int, state: str, task: str | None) -> dict[str, Any]:
    return {"id": i, "id_task": task, "model": "m", "state": state, "prompt": "",
            "next_token": {"n_decoded": 3, "n_remain": 5}}  # fmt: skip


def _answer(replica: str, body: Any, status: int = 200) -> Answer:
    return Answer(replica, status, json.dumps(body).encode())


def _props(slots: int, free: int, parked: int, loaded: bool = True) -> dict[str, Any]:
    kv = {"block_size": 16, "blocks_total": 100, "blocks_free": free, "blocks_parked": parked}
    return {"model_alias": "m", "total_slots": slots, "loaded": loaded, "kv": kv,
            "build_info": "ferrum", "default_model": "m"}  # fmt: skip


def test_slots_of_every_replica_are_listed_once_each_marked_with_its_replica():
    a = [_slot(0, "decoding", "chatcmpl-mine"), _slot(1, "idle", None)]
    b = [_slot(0, "prefill", None)]  # another key's request: the replica hid its id
    again = [_slot(0, "decoding", "chatcmpl-mine")]  # a pin rerouted to `a`: asked twice
    status, body = merge("/slots", [_answer("a", a), _answer("b", b), _answer("a", again)])
    assert status == 200
    assert [(s["replica"], s["id"], s["state"]) for s in body] == [
        ("a", 0, "decoding"),
        ("a", 1, "idle"),
        ("b", 0, "prefill"),
    ]
    assert [s["id_task"] for s in body] == ["chatcmpl-mine", None, None]
    for entry, given in zip(body, a + b, strict=True):
        assert {k: v for k, v in entry.items() if k != "replica"} == given


def test_a_refusal_passes_through_and_a_failed_replica_is_left_out():
    refused = {"error": {"message": "invalid API key", "type": "authentication_error"}}
    assert merge("/slots", [_answer("a", refused, 401), _answer("b", refused, 401)]) == (
        401,
        refused,
    )
    cut = Answer("b", 200, b'[{"id": 0')  # a replica that died mid-answer
    failed = _answer("c", {"error": {"message": "boom"}}, 500)
    status, body = merge("/slots", [_answer("a", [_slot(0, "idle", None)]), cut, failed])
    assert status == 200 and [s["replica"] for s in body] == ["a"]
    assert merge("/slots", [cut, failed]) is None
    assert merge("/props", []) is None


def test_props_add_up_the_cluster_and_keep_each_replicas_own():
    answers = [_answer("a", _props(4, 60, 10)), _answer("b", _props(2, 90, 0))]
    status, body = merge("/props", answers)
    assert status == 200 and body["loaded"] is True
    assert body["total_slots"] == 6
    assert body["kv"] == {"block_size": 16, "blocks_total": 200, "blocks_free": 150,
                          "blocks_parked": 10}  # fmt: skip
    assert [(p["replica"], p["kv"]["blocks_free"]) for p in body["replicas"]] == [
        ("a", 60),
        ("b", 90),
    ]
    assert body["model_alias"] == "m" and "replica" not in body


def test_props_of_a_model_loaded_on_one_replica_only_count_that_one():
    unloaded = {"model_alias": "m", "loaded": False, "build_info": "ferrum"}
    status, body = merge("/props", [_answer("a", unloaded), _answer("b", _props(4, 50, 5))])
    assert body["loaded"] is True and body["total_slots"] == 4
    assert body["kv"]["blocks_total"] == 100
    assert [p["loaded"] for p in body["replicas"]] == [False, True]
    status, body = merge("/props", [_answer("a", unloaded)])
    assert status == 200 and body["loaded"] is False and "kv" not in body


def test_a_replica_is_named_by_the_last_part_of_its_ray_id():
    assert short_id("ferrum#FerrumReplica#x7k2p") == "x7k2p"
