"""The cluster's routing: the policies (pure), and the engine's side of it (the block hashes
a replica reports are the ones the ingress computes for the same tokens)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from ferrum.cluster.policy import (
    Candidate,
    PrefixAffinity,
    RouteKey,
    TextPrefixAffinity,
    decode_hashes,
    encode_hashes,
    pinned,
    power_of_two,
)
from ferrum.engine.async_engine import AsyncEngine
from ferrum.engine.kv.prefix import Parked, PrefixIndex, block_hashes
from ferrum.errors import ServiceUnavailable
from tests.factories import FakeRunner, byte_tokenize, fake_engine, sampling

BS = 4


def key(tokens: list[int], model: str = "m") -> RouteKey:
    return RouteKey(model, tuple(block_hashes(tokens, BS, "")))


def loads(**in_flight: int) -> list[Candidate]:
    return [Candidate(r, n) for r, n in in_flight.items()]


def test_hashes_travel_as_bytes():
    hashes = [hash((0, (1, 2))), -5, 2**63 - 1, -(2**63)]
    assert decode_hashes(encode_hashes(hashes)) == frozenset(hashes)


def test_the_index_reports_the_hashes_the_ingress_computes():
    index = PrefixIndex(BS)
    tokens = list(range(1, 23))  # 5 full blocks and 2 tokens
    index.add(Parked(1, tokens))
    assert index.resident_hashes(100) == list(block_hashes(tokens, BS, ""))
    assert len(index.resident_hashes(100)) == 5


def test_a_bounded_summary_keeps_the_shallow_blocks_of_every_owner():
    index = PrefixIndex(BS)
    a, b = list(range(100, 140)), list(range(200, 240))  # 10 blocks each
    index.add(Parked(1, a))
    index.add(Parked(2, b))
    held = index.resident_hashes(6)
    assert held[:2] == [next(block_hashes(a, BS, "")), next(block_hashes(b, BS, ""))]
    first_three = list(block_hashes(a, BS, ""))[:3] + list(block_hashes(b, BS, ""))[:3]
    assert set(held) == set(first_three)


def test_shared_blocks_are_reported_once():
    index = PrefixIndex(BS)
    system = list(range(8))
    index.add(Parked(1, system + [50, 51, 52, 53]))
    index.add(Parked(2, system + [60, 61, 62, 63]))
    held = index.resident_hashes(100)
    assert len(held) == len(set(held)) == 4


def test_the_longest_holder_wins():
    policy = PrefixAffinity(rng=random.Random(0))
    system, chat = list(range(16)), list(range(100, 116))
    policy.observe("a", {"m": frozenset(block_hashes(system, BS, ""))})
    policy.observe("b", {"m": frozenset(block_hashes(system + chat, BS, ""))})
    ranks = policy.choose(key(system + chat + [7] * 8), loads(a=0, b=2))
    assert ranks[0] == ["b"]
    assert policy.choose(key(system + [9] * 16), loads(a=0, b=2))[0] == ["a"]  # a: less loaded


def test_an_overloaded_holder_is_passed_over():
    policy = PrefixAffinity(imbalance=4, rng=random.Random(0))
    tokens = list(range(32))
    policy.observe("a", {"m": frozenset(block_hashes(tokens, BS, ""))})
    assert policy.choose(key(tokens), loads(a=3, b=0))[0] == ["a"]
    ranks = policy.choose(key(tokens), loads(a=4, b=0))
    assert ranks == [["b", "a"]]  # power of two: the less loaded first


def test_other_models_blocks_do_not_count():
    policy = PrefixAffinity(rng=random.Random(0))
    tokens = list(range(32))
    policy.observe("a", {"other": frozenset(block_hashes(tokens, BS, ""))})
    assert policy.matched_blocks("a", key(tokens), now=0.0) == 0


def test_what_the_router_sent_counts_until_summaries_catch_up():
    policy = PrefixAffinity(recent_s=10.0, rng=random.Random(0))
    turn1 = list(range(40))
    policy.routed("b", key(turn1), now=100.0)
    turn2 = key(turn1 + list(range(500, 520)))
    assert policy.choose(turn2, loads(a=0, b=1), now=105.0)[0] == ["b"]
    assert policy.matched_blocks("b", turn2, now=111.0) == 0  # expired
    policy.observe("b", {"m": frozenset(block_hashes(turn1, BS, ""))})
    assert policy.matched_blocks("b", turn2, now=111.0) == 10


def test_a_forgotten_replica_holds_nothing():
    policy = PrefixAffinity(rng=random.Random(0))
    tokens = list(range(32))
    policy.observe("a", {"m": frozenset(block_hashes(tokens, BS, ""))})
    policy.routed("a", key(tokens), now=0.0)
    policy.forget("a")
    assert policy.matched_blocks("a", key(tokens), now=0.0) == 0


def test_no_match_is_power_of_two():
    policy = PrefixAffinity(rng=random.Random(1))
    seen = set()
    for _ in range(50):
        ranks = policy.choose(key(list(range(32))), loads(a=1, b=1, c=1))
        assert len(ranks) == 1 and len(ranks[0]) == 2
        seen.add(tuple(sorted(ranks[0])))
    assert len(seen) == 3  # every pair gets drawn


def test_power_of_two_puts_the_less_loaded_first():
    rank = power_of_two(loads(a=3, b=1), random.Random(0))
    assert rank == [["b", "a"]]
    assert power_of_two([], random.Random(0)) == []


def test_a_pin_wins_while_its_replica_lives():
    assert pinned(RouteKey(pin="b"), loads(a=0, b=9)) == [["b"]]
    assert pinned(RouteKey(pin="gone"), loads(a=0, b=9)) is None
    assert pinned(RouteKey(), loads(a=0)) is None


def test_text_policy_follows_the_longest_text_match():
    policy = TextPrefixAffinity(rng=random.Random(0))
    system = "You are a helpful assistant who answers in French. " * 4
    policy.routed("a", RouteKey(text=system + "Question one?"))
    ranks = policy.choose(RouteKey(text=system + "Question two?"), loads(a=3, b=0))
    assert ranks == [["a"]]  # balanced by default (infinite threshold): the match wins


def test_text_policy_below_the_match_rate_goes_to_the_smallest_tree():
    policy = TextPrefixAffinity(rng=random.Random(0))
    policy.routed("a", RouteKey(text="x" * 400))
    ranks = policy.choose(RouteKey(text="y" * 400), loads(a=0, b=0))
    assert ranks == [["b"]]


def test_text_policy_imbalance_is_power_of_two():
    policy = TextPrefixAffinity(imbalanced_threshold=2, rng=random.Random(0))
    policy.routed("a", RouteKey(text="z" * 400))
    ranks = policy.choose(RouteKey(text="z" * 400), loads(a=5, b=0))
    assert ranks == [["b", "a"]]


def test_the_engine_reports_what_it_holds():
    engine = fake_engine(FakeRunner(), block_size=BS)
    prompt = byte_tokenize("a prompt long enough for several blocks")
    engine.add_request("r", prompt, sampling(max_tokens=2), True)
    while engine.has_work:
        engine.step()
    held = engine.resident_prefixes(1000)
    assert held.block_size == BS
    assert set(block_hashes(prompt, BS, "")) <= set(held.hashes)
    assert fake_engine(FakeRunner(), prefix_cache=False).resident_prefixes(10).hashes == ()


def test_a_call_runs_on_the_engine_thread_and_is_refused_once_stopped():
    async def scenario() -> None:
        front = AsyncEngine(fake_engine(FakeRunner()))
        front.start()
        name = await front.on_engine_thread(lambda: threading.current_thread().name)
        assert name == "ferrum-engine"
        with pytest.raises(ZeroDivisionError):
            await front.on_engine_thread(lambda: 1 // 0)
        assert front.alive  # an error in a call does not stop the engine
        await front.stop()
        with pytest.raises(ServiceUnavailable):
            await front.on_engine_thread(lambda: None)

    asyncio.run(scenario())


class _PromptKeys:
    """What `route_key` needs of a model's prompt keys: its name and the prompt's tokens."""

    name = "m"
    max_text_bytes = 1000
    adapters: tuple = ()

    def __init__(self, tokens: list[int]):
        self._tokens = tokens

    def tokens(self, body: object) -> list[int]:
        return self._tokens


def _completion(text: str) -> object:
    from ferrum.api.openai.bodies import CompletionRequest

    return CompletionRequest(model="m", prompt=text)


def test_route_keys_match_only_the_blocks_of_the_requests_own_scope():
    """The ingress chains a prompt from its cache scope as the replica's index does: a key's
    prompt is routed to the replica holding its own blocks, never to one holding only
    another key's copy of them (the router would show where another key's prompt lives)."""
    from ferrum.cluster.keys import route_key
    from ferrum.engine.request import Request

    prompt = byte_tokenize("a prompt long enough for several blocks")
    engine = fake_engine(FakeRunner(), block_size=BS)
    engine.add_request("r", prompt, sampling(max_tokens=2, cache_scope="key:a"), True)
    while engine.has_work:
        engine.step()
    held = set(engine.resident_prefixes(1000).hashes)
    body = _completion("a prompt long enough for several blocks")
    own = route_key(_PromptKeys(prompt), body, BS, "key:a")  # type: ignore[arg-type]
    other = route_key(_PromptKeys(prompt), body, BS, "key:b")  # type: ignore[arg-type]
    assert own.hashes and set(own.hashes) <= held
    assert other.hashes and not set(other.hashes) & held
    index = PrefixIndex(BS)
    index.add(Request("x", prompt, sampling(cache_scope="key:b")))
    assert set(other.hashes) == set(index.resident_hashes(1000))


def test_a_prompt_longer_than_the_context_could_hold_is_routed_without_tokenizing():
    from ferrum.cluster.keys import route_key

    class Refuses(_PromptKeys):
        def tokens(self, body: object) -> list[int]:
            raise AssertionError("tokenized a prompt the replica refuses unread")

    key = route_key(Refuses([]), _completion("x" * 1001), BS, "key:a")  # type: ignore[arg-type]
    assert key.model == "m" and not key.hashes


def test_route_keys_carry_the_adapter_set_as_the_replica_does():
    """A request for an adapter (by name `BASE:NAME` or llama-server's `lora` field) is keyed
    with its adapter set, as the replica's index chains its blocks: it matches the replica
    holding its own adapter's blocks, never the base's or another adapter's."""
    from ferrum.api.openai.bodies import CompletionRequest
    from ferrum.cluster.keys import route_key
    from ferrum.models.adapters import LoraAdapter, files_scope

    text = "a prompt long enough for several blocks"
    prompt = byte_tokenize(text)
    keys = _PromptKeys(prompt)
    keys.adapters = (
        LoraAdapter("sql", "/a/sql.gguf", 0.5, digest="d-sql"),
        LoraAdapter("chat", "/a/c.gguf", digest="d-chat"),
    )

    def held(adapters: tuple) -> set[int]:  # the scope as a replica's serving.submit sets it
        engine = fake_engine(FakeRunner(), block_size=BS)
        scope = "key:a" + files_scope(keys.adapters, adapters)
        params = sampling(max_tokens=2, cache_scope=scope, adapters=adapters)
        engine.add_request("r", prompt, params, True)
        while engine.has_work:
            engine.step()
        return set(engine.resident_prefixes(1000).hashes)

    def key(**body: object) -> set[int]:
        request = CompletionRequest.model_validate({"prompt": text, **body})
        return set(route_key(keys, request, BS, "key:a").hashes)  # type: ignore[arg-type]

    sql, base = held(((0, 0.5),)), held(())
    assert key(model="m:sql") and key(model="m:sql") <= sql
    assert key(model="m", lora=[{"id": 0, "scale": 0.5}]) == key(model="m:sql")
    assert not key(model="m:sql") & base
    assert key(model="m") <= base and not key(model="m") & sql
    assert not key(model="m:chat") & sql
    assert key(model="m", lora=[{"id": 9}]) == set()  # a bad pick: the replica answers it
    # The same name, id and scale from another file: another adapter, none of its blocks.
    keys.adapters = (LoraAdapter("sql", "/a/sql.gguf", 0.5, digest="d-new"), keys.adapters[1])
    assert key(model="m:sql") and not key(model="m:sql") & sql
