"""Prefix reuse on the fake runner: reused output == fresh output, one prefill per shared
prefix, takeover for conversations, eviction under pressure, nothing copied for recurrent
models, and the ledger intact throughout."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ferrum.engine.kv.prefix import Parked, PrefixIndex, block_hashes
from tests.factories import (
    FakeRunner,
    byte_tokenize,
    fake_engine,
    model_info,
    run_to_completion,
    sampling,
)
from tests.profiles import examples

SYSTEM = "You are a careful assistant. Answer in one short line. " * 2  # 112 bytes


def _run(engine, prompts: dict[str, str], max_tokens: int = 8) -> dict[str, dict]:
    """Adds all prompts at once, steps to idle, returns content and final output per id."""
    for rid, p in prompts.items():
        engine.add_request(rid, byte_tokenize(p), sampling(max_tokens=max_tokens))
    return run_to_completion(engine)


def _fresh(prompt: str, max_tokens: int = 8) -> str:
    return _run(fake_engine(prefix_cache=False), {"r": prompt}, max_tokens)["r"]["content"]


def _best(idx: PrefixIndex, tokens: list[int]) -> tuple[object, int]:
    m = next(idx.matches(tokens, ""), None)
    return (None, 0) if m is None else (m.owner, m.length)


def test_index_matches_longest_prefix_token_by_token():
    idx = PrefixIndex(4)
    a = Parked(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = Parked(1, [1, 2, 3, 4, 5, 6, 0, 0])
    idx.add(a)
    idx.add(b)
    assert _best(idx, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == (a, 9)
    assert _best(idx, [1, 2, 3, 4, 5, 6, 0, 1]) == (b, 7)
    assert _best(idx, [1, 2, 3]) == (None, 0)  # less than one block never matches
    idx.remove(a)
    assert _best(idx, [1, 2, 3, 4, 5, 6, 7, 8]) == (b, 6)
    idx.remove(b)
    assert len(idx) == 0 and _best(idx, [1, 2, 3, 4]) == (None, 0)


def test_index_lists_every_owner_of_a_prefix_longest_first():
    """A donor that cannot serve its match leaves the planner the next owner, down to owners
    that share only the first block (a common system prompt)."""
    idx = PrefixIndex(4)
    short = Parked(0, [1, 2, 3, 4, 9, 9, 9, 9])
    long_ = Parked(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    sibling = Parked(2, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    for owner in (short, long_, sibling):
        idx.add(owner)
    found = [(m.owner, m.length) for m in idx.matches([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "")]
    assert found == [(long_, 9), (sibling, 8), (short, 4)]
    assert [m.owner for m in idx.matches([1, 2, 3, 5], "")] == []


def test_identical_prompt_reuses_all_but_the_last_token():
    engine = fake_engine()
    prompt = SYSTEM + "What is two plus two?"
    first = _run(engine, {"a": prompt})["a"]
    second = _run(engine, {"b": prompt})["b"]
    assert first["final"].cached_tokens == 0
    n_prompt = len(byte_tokenize(prompt))
    assert second["final"].cached_tokens == n_prompt - 1  # last token re-decoded for logits
    assert second["content"] == first["content"] == _fresh(prompt)


def test_burst_behind_a_shared_prefix_prefills_it_once():
    runner = FakeRunner()
    engine = fake_engine(runner)
    computed = []
    engine.observer.on_step = lambda s: computed.append(s.prompt_tokens_computed)
    prompts = {f"q{i}": SYSTEM + f"Question number {i}?" for i in range(4)}
    res = _run(engine, prompts)
    for rid, p in prompts.items():
        assert res[rid]["content"] == _fresh(p)
    shared = len(byte_tokenize(SYSTEM + "Question number "))
    total = sum(len(byte_tokenize(p)) for p in prompts.values())
    assert sum(computed) <= total - 3 * (shared - 16)  # three newcomers skipped the prefix
    assert len(runner.copies) == 3 and {src for src, _, _ in runner.copies} == {0}


def test_next_turn_of_a_conversation_takes_over_its_parked_sequence():
    runner = FakeRunner()
    engine = fake_engine(runner)
    history = SYSTEM + "User: hi\nAssistant:"
    turns = []
    for turn in range(5):
        out = _run(engine, {f"t{turn}": history}, max_tokens=6)[f"t{turn}"]
        assert out["content"] == _fresh(history, 6)
        turns.append(out["final"].cached_tokens)
        history += out["content"] + f"\nUser: and {turn}?\nAssistant:"
    assert turns[0] == 0 and all(c > 0 for c in turns[1:])
    assert runner.copies == []  # every turn continued the previous turn's own sequence
    assert len(engine.kv_manager.parked) == 1


def test_parked_sequences_are_evicted_lru_under_block_pressure():
    runner = FakeRunner(info=model_info(n_ctx=256, n_batch=64, n_seq_max=8))
    engine = fake_engine(runner)
    for i in range(6):  # each ~60 positions: 256 cells cannot keep them all
        _run(engine, {f"r{i}": f"{i} " * 26}, max_tokens=6)
        engine.check_integrity()
    assert engine.kv_manager.evictions > 0
    assert (
        engine.kv_manager.blocks.num_free + engine.kv_manager.parked.num_blocks
        == engine.kv_manager.blocks.num_blocks
    )
    latest = _run(engine, {"again": "5 " * 26}, max_tokens=6)["again"]
    assert latest["final"].cached_tokens > 0  # the most recent one survived


def test_recurrent_models_never_copy_state_but_continue_their_own():
    runner = FakeRunner(info=model_info(is_recurrent=True))
    engine = fake_engine(runner)
    prompt = SYSTEM + "Tell me more."
    a = _run(engine, {"a": prompt, "b": prompt})
    assert a["a"]["final"].cached_tokens == a["b"]["final"].cached_tokens == 0
    follow = prompt + a["a"]["content"] + " And then?"
    b = _run(engine, {"c": follow})["c"]
    assert runner.copies == []
    assert b["final"].cached_tokens > 0 and b["content"] == _fresh(follow)


@settings(max_examples=examples(30), deadline=None)
@given(
    plan=st.lists(
        st.tuples(
            st.sampled_from(["add", "abort", "step", "step"]), st.integers(0, 5), st.integers(1, 12)
        ),
        max_size=50,
    )
)
def test_random_shared_prefix_workloads_keep_the_ledger_and_the_outputs(plan):
    engine = fake_engine(
        FakeRunner(info=model_info(n_ctx=192, n_batch=48, n_seq_max=6)), block_size=8
    )
    bases = ["shared system prompt, version one. ", "another preamble that is shared. "]
    expected: dict[str, str] = {}
    contents: dict[str, str] = {}
    aborted: set[str] = set()
    for i, (op, a, b) in enumerate(plan):
        if op == "add":
            rid = f"r{i}"
            prompt = bases[a % 2] * (1 + a % 3) + f"q{b}"
            engine.add_request(rid, byte_tokenize(prompt), sampling(max_tokens=b))
            expected[rid] = _fresh(prompt, b)
        elif op == "abort" and expected:
            rid = list(expected)[a % len(expected)]
            if engine.abort(rid) is not None:
                aborted.add(rid)
        elif engine.has_work:
            for out in engine.step():
                contents[out.request_id] = contents.get(out.request_id, "") + out.content
        engine.check_integrity()
    for rid, r in run_to_completion(engine).items():
        contents[rid] = contents.get(rid, "") + r["content"]
    for rid, text in expected.items():
        if rid not in aborted:
            assert contents.get(rid, "") == text
    engine.kv_manager.drop_parked()
    engine.check_integrity()
    assert engine.kv_manager.blocks.num_free == engine.kv_manager.blocks.num_blocks


def test_a_donor_that_lost_its_window_gives_way_to_the_next_owner():
    """On a sliding-window model a donor may have lost window cells (`holds_window` False): the
    planner takes the next owner of the prefix, then a fresh prefill, and counts the fallback."""
    runner = FakeRunner()
    engine = fake_engine(runner)
    _run(engine, {"a": SYSTEM + "first question"})
    second = _run(engine, {"c": SYSTEM + "second question"})
    assert second["c"]["final"].cached_tokens > 0  # c copied the system prompt from a
    a_seq = runner.copies[-1][0]
    runner.lost_windows.add(a_seq)
    shared = second["c"]["final"].cached_tokens
    third = _run(engine, {"b": SYSTEM + "third question"})["b"]
    assert third["final"].cached_tokens == shared  # from c
    assert runner.copies[-1][0] != a_seq
    assert engine.kv_manager.window_fallbacks == 1
    assert third["content"] == _fresh(SYSTEM + "third question")
    runner.lost_windows |= {p.seq_id for p in engine.kv_manager.parked}
    fourth = _run(engine, {"d": SYSTEM + "fourth question"})["d"]
    assert fourth["final"].cached_tokens == 0
    assert engine.kv_manager.window_fallbacks == 2
    assert fourth["content"] == _fresh(SYSTEM + "fourth question")


def _scoped(engine, prompts: dict[str, tuple[str, str]], max_tokens: int = 8) -> dict[str, dict]:
    """Like _run, each prompt with its cache scope: {id: (scope, prompt)}."""
    for rid, (scope, p) in prompts.items():
        params = sampling(max_tokens=max_tokens, cache_scope=scope)
        engine.add_request(rid, byte_tokenize(p), params)
    return run_to_completion(engine)


def test_a_prompt_of_another_scope_reuses_nothing():
    """Key B sends key A's prompt: nothing cached (it would tell B what A sent); A again
    reuses it as before."""
    runner = FakeRunner()
    engine = fake_engine(runner)
    prompt = SYSTEM + "my secret is 4711"
    n = len(byte_tokenize(prompt))
    first = _scoped(engine, {"a": ("key:a", prompt)})["a"]
    other = _scoped(engine, {"b": ("key:b", prompt)})["b"]
    again = _scoped(engine, {"a2": ("key:a", prompt)})["a2"]
    assert (first["final"].cached_tokens, other["final"].cached_tokens) == (0, 0)
    assert again["final"].cached_tokens == n - 1
    assert first["content"] == other["content"] == again["content"] == _fresh(prompt)
    engine.check_integrity()


def test_scopes_never_wait_for_copy_from_or_take_over_each_other():
    """The other reuse paths: a running donor of another scope is neither waited for nor
    copied from, and another scope's parked conversation is not continued."""
    runner = FakeRunner()
    engine = fake_engine(runner)
    prompt = SYSTEM + "Tell me more."
    both = _scoped(engine, {"a": ("key:a", prompt), "b": ("key:b", prompt)})
    assert both["a"]["final"].cached_tokens == both["b"]["final"].cached_tokens == 0
    assert runner.copies == []
    follow = prompt + both["a"]["content"] + " And then?"
    turn = _scoped(engine, {"c": ("salt:c", follow)})["c"]
    assert turn["final"].cached_tokens == 0 and turn["content"] == _fresh(follow)
    same = _scoped(engine, {"d": ("key:a", follow)})["d"]
    assert same["final"].cached_tokens > 0 and runner.copies == []  # took over a's sequence


def test_the_index_hides_other_scopes_inside_the_first_block_too():
    """The token-by-token extension happens only behind a full block found in the prompt's own
    scope: no owner of another scope is ever a match, however many tokens it shares."""
    idx = PrefixIndex(4)
    secret = Parked(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], cache_scope="key:a")
    idx.add(secret)
    assert list(idx.matches([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "key:b")) == []
    assert list(idx.matches([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "")) == []
    assert _best_in(idx, [1, 2, 3, 4, 5, 6, 7, 0], "key:a") == (secret, 7)
    block = [1, 2, 3, 4]
    assert list(block_hashes(block, 4, "key:a")) != list(block_hashes(block, 4, "key:b"))
    # The shared scope "" chains from 0, as before scopes: a single-tenant server's chains and
    # a cluster's route keys are unchanged.
    assert list(block_hashes([1, 2, 3, 4], 4, "")) == [hash((0, (1, 2, 3, 4)))]


def _best_in(idx: PrefixIndex, tokens: list[int], scope: str) -> tuple[object, int]:
    m = next(idx.matches(tokens, scope), None)
    return (None, 0) if m is None else (m.owner, m.length)


def test_the_ledger_check_refuses_a_block_shared_across_scopes():
    """`check_integrity` proves the rule on the ledger: were a block ever shared outside the
    scoped index, the next idle check says so."""
    import pytest

    from ferrum.engine.kv.ledger import IntegrityError

    engine = fake_engine()
    _scoped(engine, {"a": ("key:a", SYSTEM)})
    kv = engine.kv_manager
    (parked,) = kv.parked
    seq = kv.seq_ids.acquire()
    table = kv.blocks.fork(parked.page_table, len(parked.all_token_ids))
    kv.parked.add(Parked(seq, list(parked.all_token_ids), table, "key:b"))
    with pytest.raises(IntegrityError, match="shared across cache scopes"):
        engine.check_integrity()
