"""Saved prefixes in RAM and on disk: restored output equals a fresh prefill, bounds hold, and
every fault (a bad file, a full disk, a refused restore, another server) falls back to a fresh
prefill with a counter, never a crash or wrong output."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from ferrum.engine.engine import LLMEngine
from ferrum.engine.kv.prefix import PrefixIndex
from ferrum.engine.kv.tiers import Costs, Saved, SavedStates, Tier, TierConfig
from ferrum.engine.kv.tiers import files as tier_files
from tests.factories import FakeRunner, byte_tokenize, model_info, run_to_completion, sampling

FP = "model-a"


class AlwaysRestore(Costs):
    """The fake model prefills in microseconds, so measured costs would (rightly) refuse most
    restores; these tests are about the tiers' mechanics, `test_costs_*` about the choice."""

    def worth(self, entry: Saved, tokens_saved: int) -> bool:
        return True


def _restoring(engine: LLMEngine) -> LLMEngine:
    if engine.kv_manager.saved is not None:
        engine.kv_manager.saved.costs = AlwaysRestore()
    return engine


def _prompts(n: int) -> list[list[int]]:
    return [byte_tokenize(f"chat {i}: " + "the quick brown fox jumps " * 4) for i in range(n)]


def _engine(
    folder: Path | None,
    ram: int = 100_000,
    disk: int = 1_000_000,
    runner: FakeRunner | None = None,
    fingerprint: str = FP,
    prefix_cache: bool = True,
) -> tuple[FakeRunner, LLMEngine]:
    """A KV pool of 256 positions: two 100-token chats fit beside one another, not six."""
    runner = runner or FakeRunner(info=model_info(n_ctx=256, n_batch=64, n_seq_max=4))
    tiers = TierConfig(ram, disk if folder else 0, folder, fingerprint, io_thread=False)
    engine = LLMEngine(runner, block_size=16, max_running=2, tiers=tiers, prefix_cache=prefix_cache)
    return runner, _restoring(engine)


def _ask(engine: LLMEngine, rid: str, prompt: list[int], scope: str = "") -> tuple[list[int], int]:
    engine.add_request(rid, prompt, sampling(max_tokens=8, cache_scope=scope))
    out = run_to_completion(engine)[rid]
    engine.check_integrity()
    return out["tokens"], out["final"].cached_tokens


def _fresh(prompt: list[int]) -> list[int]:
    _, engine = _engine(None, ram=0, prefix_cache=False)
    return _ask(engine, "fresh", prompt)[0]


def _two_rounds(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    return [_ask(engine, f"{r}-{i}", p) for r in range(2) for i, p in enumerate(prompts)]


def test_evicted_prefixes_are_restored_from_ram_with_the_same_output() -> None:
    prompts = _prompts(6)
    runner, engine = _engine(None)
    answers = _two_rounds(engine, prompts)
    for i, p in enumerate(prompts):
        first, again = answers[i], answers[len(prompts) + i]
        assert first == (_fresh(p), 0)
        assert again == (first[0], len(p) - 1)  # all but the last prompt token restored
    stats = engine.kv_manager.saved.snapshot()
    assert stats.restores == len(prompts) == stats.ram.hits
    assert stats.restored_tokens == sum(len(p) - 1 for p in prompts)
    assert len(runner.restores) == len(prompts)


def test_a_shorter_prompt_restores_a_prefix_of_a_saved_state() -> None:
    prompts = _prompts(6)
    _, engine = _engine(None)
    for i, p in enumerate(prompts):
        _ask(engine, f"a{i}", p)
    shorter = prompts[0][:70]
    tokens, cached = _ask(engine, "short", shorter)
    assert (tokens, cached) == (_fresh(shorter), 69)


def test_ram_bound_drops_the_least_recently_used() -> None:
    prompts = _prompts(6)
    # Each fake state is 4 bytes a token (~420 bytes): room for two.
    _, engine = _engine(None, ram=900)
    _two_rounds(engine, prompts)
    saved = engine.kv_manager.saved
    stats = saved.snapshot()
    assert stats.ram.bytes <= 900 and stats.ram.entries <= 2
    assert len(saved) == stats.ram.entries  # no disk tier: out of RAM is forgotten
    assert stats.restores == 0  # LRU order: each chat came back after two others pushed it out


def test_a_restart_answers_from_disk_with_the_same_output(tmp_path: Path) -> None:
    prompts = _prompts(3)
    _, engine = _engine(tmp_path)
    first = [_ask(engine, f"a{i}", p) for i, p in enumerate(prompts)]
    engine.shutdown()  # parked sequences are saved too
    assert len(list(tmp_path.glob("*.kv"))) >= len(prompts)

    runner, engine = _engine(tmp_path)
    assert len(engine.kv_manager.saved) >= len(prompts)
    for i, p in enumerate(prompts):
        assert _ask(engine, f"b{i}", p) == (first[i][0], len(p) - 1)
    stats = engine.kv_manager.saved.snapshot()
    assert stats.disk.hits == len(prompts) and stats.failures == 0


def test_the_disk_tier_keeps_what_ram_drops(tmp_path: Path) -> None:
    prompts = _prompts(6)
    _, engine = _engine(tmp_path, ram=900)
    answers = _two_rounds(engine, prompts)
    assert [a[1] for a in answers[6:]] == [len(p) - 1 for p in prompts]
    stats = engine.kv_manager.saved.snapshot()
    assert stats.disk.hits == 6 and stats.ram.bytes <= 900


def test_disk_bound_deletes_the_oldest_files(tmp_path: Path) -> None:
    _, engine = _engine(tmp_path, ram=900, disk=1_500)
    _two_rounds(engine, _prompts(6))
    files = list(tmp_path.glob("*.kv"))
    assert sum(f.stat().st_size for f in files) <= 1_500
    assert engine.kv_manager.saved.snapshot().disk.entries == len(files)


def _saved_folder(tmp_path: Path, n: int = 2) -> list[list[int]]:
    prompts = _prompts(n)
    _, engine = _engine(tmp_path)
    for i, p in enumerate(prompts):
        _ask(engine, f"a{i}", p)
    engine.shutdown()
    return prompts


def _restart_and_ask(tmp_path: Path, prompt: list[int], **kw: object) -> tuple[LLMEngine, int]:
    _, engine = _engine(tmp_path, **kw)  # type: ignore[arg-type]
    tokens, cached = _ask(engine, "again", prompt)
    assert tokens == _fresh(prompt)
    return engine, cached


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_file_is_deleted_and_prefilled_afresh(tmp_path: Path, damage: str) -> None:
    prompt = _saved_folder(tmp_path, 1)[0]
    (path,) = tmp_path.glob("*.kv")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF  # the header still reads: caught by the checksum at load time
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    engine, cached = _restart_and_ask(tmp_path, prompt)
    assert cached == 0
    assert not path.exists()
    if damage == "flip":
        assert engine.kv_manager.saved.snapshot().failures == 1


def test_a_saved_state_is_restored_only_in_its_own_scope_before_and_after_a_restart(
    tmp_path: Path,
) -> None:
    prompts = _prompts(6)
    _, engine = _engine(tmp_path)
    for i, p in enumerate(prompts):  # each pushes older ones out of the pool into the tiers
        _ask(engine, f"a{i}", p, scope="key:a")
    assert _ask(engine, "b0", prompts[0], scope="key:b") == (_fresh(prompts[0]), 0)
    first = [e for e in engine.kv_manager.saved if e.all_token_ids[: len(prompts[0])] == prompts[0]]
    assert "key:a" in {e.cache_scope for e in first}  # there, but not for key B
    engine.shutdown()

    _, engine = _engine(tmp_path)  # the folder indexed again: each entry with its scope
    for i, p in enumerate(prompts[1:]):
        assert _ask(engine, f"b{i}", p, scope="key:b") == (_fresh(p), 0)
        assert _ask(engine, f"s{i}", p, scope="") == (_fresh(p), 0)
    assert engine.kv_manager.saved.snapshot().restores == 0
    assert _ask(engine, "a", prompts[1], scope="key:a") == (_fresh(prompts[1]), len(prompts[1]) - 1)
    assert engine.kv_manager.saved.snapshot().disk.hits == 1


def test_files_of_the_format_without_scopes_are_deleted_never_loaded(tmp_path: Path) -> None:
    """Read as the shared scope "", an older file would hand one key's prompt to everyone."""
    import json
    import zlib

    tokens, state = list(range(40)), b"state" * 8
    toks = tier_files.token_bytes(tokens)
    crc = zlib.crc32(state, zlib.crc32(toks))
    meta = {"fingerprint": FP, "tokens": 40, "state_bytes": len(state), "crc32": crc}
    header = json.dumps(meta).encode()
    old = tmp_path / (hashlib.sha256(toks).hexdigest()[:32] + ".kv")
    old.write_bytes(b"FERRUMKV1\n" + len(header).to_bytes(4, "little") + header + toks + state)
    store = SavedStates(TierConfig(1000, 10_000, tmp_path, FP, io_thread=False), PrefixIndex(4))
    assert len(store) == 0 and not old.exists()


def test_another_models_files_are_deleted_never_loaded(tmp_path: Path) -> None:
    prompt = _saved_folder(tmp_path, 1)[0]
    engine, cached = _restart_and_ask(tmp_path, prompt, fingerprint="model-b")
    assert cached == 0 and len(engine.kv_manager.saved) == 0
    assert not list(tmp_path.glob("*.kv"))


def test_leftovers_of_an_unfinished_write_are_removed(tmp_path: Path) -> None:
    prompt = _saved_folder(tmp_path, 1)[0]
    dead = tmp_path / ".0123abcd.999999999.tmp"  # no such process
    dead.write_bytes(b"half a file")
    engine, cached = _restart_and_ask(tmp_path, prompt)
    assert cached == len(prompt) - 1
    assert not dead.exists()


def test_a_crash_mid_write_leaves_no_file_under_the_final_name(tmp_path: Path) -> None:
    class Crash(BaseException):
        pass

    def crashing_fsync(fd: int) -> None:
        raise Crash

    real = os.fsync
    os.fsync = crashing_fsync  # type: ignore[assignment]
    try:
        with pytest.raises(Crash):
            tier_files.write_entry(tmp_path / "k.kv", FP, [1, 2, 3], "", bytearray(b"state"))
    finally:
        os.fsync = real
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_keeps_the_state_in_ram(tmp_path: Path, monkeypatch) -> None:
    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier_files, "write_entry", full)
    prompts = _prompts(6)
    _, engine = _engine(tmp_path)
    answers = _two_rounds(engine, prompts)
    assert [a[1] for a in answers[6:]] == [len(p) - 1 for p in prompts]  # from RAM
    stats = engine.kv_manager.saved.snapshot()
    assert stats.write_failures >= 4 and stats.disk.entries == 0
    assert not list(tmp_path.iterdir())


def test_a_refused_restore_falls_back_to_prefill(tmp_path: Path) -> None:
    prompts = _prompts(6)
    runner = FakeRunner(info=model_info(n_ctx=256, n_batch=64, n_seq_max=4), refuse_restores=True)
    _, engine = _engine(tmp_path, runner=runner)
    answers = _two_rounds(engine, prompts)
    for i, p in enumerate(prompts):
        assert answers[6 + i] == (_fresh(p), 0)
    stats = engine.kv_manager.saved.snapshot()
    assert stats.failures >= 1 and stats.restores == 0


def test_two_servers_on_one_folder(tmp_path: Path) -> None:
    """Both index the same files; one deleting a file the other indexed costs the other a
    fresh prefill, nothing more."""
    prompt = _saved_folder(tmp_path, 1)[0]
    _, one = _engine(tmp_path)
    _, two = _engine(tmp_path)
    for path in tmp_path.glob("*.kv"):
        path.unlink()  # `one` evicts it under its own disk bound
    tokens, cached = _ask(two, "x", prompt)
    assert (tokens, cached) == (_fresh(prompt), 0)
    assert two.kv_manager.saved.snapshot().failures == 1
    assert _ask(one, "y", prompt)[0] == tokens


def test_no_prefix_cache_turns_the_tiers_off(tmp_path: Path) -> None:
    _, engine = _engine(tmp_path, prefix_cache=False)
    assert engine.kv_manager.saved is None
    _two_rounds(engine, _prompts(3))
    assert not list(tmp_path.iterdir())


def test_recurrent_models_restore_only_a_whole_saved_state() -> None:
    info = model_info(n_ctx=256, n_batch=64, n_seq_max=4, is_recurrent=True)
    runner, engine = _engine(None, runner=FakeRunner(info=info))
    prompts = _prompts(6)
    for i, p in enumerate(prompts):
        _ask(engine, f"a{i}", p)
    # The same prompt again would need the state cut back by one token: not for recurrent.
    assert _ask(engine, "same", prompts[0])[1] == 0
    # A prompt that extends a saved conversation restores all of it.
    saved = next(e for e in engine.kv_manager.saved if e.all_token_ids[:20] == prompts[1][:20])
    longer = saved.all_token_ids + byte_tokenize(" and then?", add_special=False)
    tokens, cached = _ask(engine, "longer", longer)
    assert (tokens, cached) == (_fresh(longer), len(saved.all_token_ids))


def test_costs_restore_only_when_measured_faster_than_prefill() -> None:
    costs = Costs()
    entry = Saved("k", list(range(1000)), 10_000_000, "", data=bytearray(1))
    assert costs.worth(entry, 1000)  # nothing measured yet: try it
    costs.prefilled(1000, 1.0)  # 1,000 tokens/s
    costs.restored(Tier.RAM, 10_000_000, 0.01)  # 1 GB/s
    assert costs.worth(entry, 1000)  # 10 ms against 1 s
    assert not costs.worth(entry, 5)  # 10 ms against 5 ms
    entry.data = None
    costs.restored(Tier.DISK, 10_000_000, 2.0)  # a slow disk: 5 MB/s
    assert not costs.worth(entry, 1000)


def test_the_index_holds_exactly_the_entries_in_a_tier(tmp_path: Path) -> None:
    index = PrefixIndex(4)
    store = SavedStates(TierConfig(100, 10_000, tmp_path, FP, io_thread=False), index)
    kept = [store.save(list(range(i, i + 20)), "", bytearray(40)) for i in range(5)]
    assert len(index) == len(store) == 5  # RAM holds 2, the disk all 5
    assert sum(e.data is not None for e in kept) == 2
    store.close()
    fresh = SavedStates(TierConfig(100, 10_000, tmp_path, FP, io_thread=False), PrefixIndex(4))
    assert sorted(len(e.all_token_ids) for e in fresh) == [20] * 5


def test_the_io_thread_reads_a_disk_entry_while_the_request_waits(tmp_path: Path) -> None:
    prompt = _saved_folder(tmp_path, 1)[0]
    runner = FakeRunner(info=model_info(n_ctx=256, n_batch=64, n_seq_max=4))
    tiers = TierConfig(100_000, 1_000_000, tmp_path, FP)  # a real I/O thread
    engine = _restoring(LLMEngine(runner, block_size=16, max_running=2, tiers=tiers))
    try:
        assert _ask(engine, "x", prompt) == (_fresh(prompt), len(prompt) - 1)
        assert engine.stalled is False
    finally:
        engine.shutdown()


def test_tiers_reach_metrics_and_health(tmp_path: Path) -> None:
    from ferrum.metrics import Metrics

    metrics = Metrics()
    runner, engine = _engine(tmp_path, ram=900)
    engine.observer = metrics
    _two_rounds(engine, _prompts(6))
    engine.publish_stats()
    tiers = metrics.snapshot()["prefix_cache"]["tiers"]
    assert tiers["restores"] == 6 and tiers["disk"]["hits"] == 6
    assert 0 < tiers["ram"]["bytes"] <= 900 and tiers["disk"]["entries"] == 6
    text = metrics.render().decode()
    assert 'ferrum_prefix_tier_hits_total{tier="disk"} 6.0' in text
    assert 'ferrum_prefix_tier_events_total{event="restores"} 6.0' in text
    assert 'ferrum_prefix_tier_entries{tier="disk"} 6.0' in text


def test_a_state_larger_than_this_pool_is_never_restored(tmp_path: Path) -> None:
    """Saved by a server with a larger context: a prompt that is a prefix of it is prefilled
    afresh here, not left waiting for room that never comes."""
    long_prompt = _prompts(1)[0] * 3  # 336 tokens: more than the small pool's 256 positions
    big = FakeRunner(info=model_info(n_ctx=1024, n_batch=64, n_seq_max=4))
    _, engine = _engine(tmp_path, runner=big)
    _ask(engine, "a", long_prompt)
    engine.shutdown()
    small = FakeRunner(info=model_info(n_ctx=256, n_batch=64, n_seq_max=4))
    _, engine = _engine(tmp_path, runner=small)
    head = long_prompt[:200]
    assert _ask(engine, "b", head) == (_fresh(head), 0)


def _parked_blocks(engine: LLMEngine, running_blocks: int = 0) -> int:
    blocks = engine.kv_manager.blocks
    return blocks.num_blocks - blocks.num_free - running_blocks


def test_parked_cells_never_outnumber_the_running_ones_in_a_decode() -> None:
    """Each parked cell costs every decoded token (llama.cpp attends over all used cells), so
    before a decode the parked sequences are cut to the running requests' blocks, the least
    recently used saved to RAM; the next request still reuses the newest one in place."""
    runner = FakeRunner(info=model_info(n_ctx=2048, n_batch=64, n_seq_max=16))
    _, engine = _engine(None, ram=10_000_000, runner=runner)
    prompts = _prompts(5)
    for i, p in enumerate(prompts[:4]):  # a quiet pool: each finishes and parks
        _ask(engine, f"a{i}", p)
    kv = engine.kv_manager
    assert len(kv.parked) >= 1 and kv.evictions >= 2  # cut at each newcomer's decodes
    # Alone, the newest parked chat is reused in place: no restore, all but one token.
    saved_before = kv.saved.snapshot().restores
    _, cached = _ask(engine, "again", prompts[3])
    assert cached == len(prompts[3]) - 1 and kv.saved.snapshot().restores == saved_before
    # While a request decodes, parked blocks never exceed its own.
    engine.add_request("long", prompts[4], sampling(max_tokens=40))
    while engine.has_work:
        engine.step()
        running = engine.scheduler.running
        if running:
            held = {b for r in running for b in r.page_table.blocks}
            assert _parked_blocks(engine, len(held)) <= len(held)
    engine.check_integrity()
    # What was cut is restored from RAM with the same output as a fresh prefill.
    tokens, cached = _ask(engine, "back", prompts[0])
    assert tokens == _fresh(prompts[0]) and cached == len(prompts[0]) - 1


def test_without_tiers_parked_sequences_stay_until_room_is_needed() -> None:
    runner = FakeRunner(info=model_info(n_ctx=2048, n_batch=64, n_seq_max=16))
    engine = LLMEngine(runner, block_size=16, max_running=2)
    for i, p in enumerate(_prompts(4)):
        engine.add_request(f"a{i}", p, sampling(max_tokens=8))
        run_to_completion(engine)
    assert len(engine.kv_manager.parked) == 4 and engine.kv_manager.evictions == 0


def test_a_window_sized_cache_copies_into_cells_of_its_own_and_keeps_a_checkpoint() -> None:
    """Where the window cache is sized to the windows (`own_copies`), a shared window cell
    would never be recycled: a copy's blocks are its own in the ledger, its state goes to the
    tiers as a checkpoint of the prefix, and a finished sequence is saved there instead of
    parked. A later request that shares the prefix restores the checkpoint, with the output
    of a fresh prefill."""
    info = model_info(n_ctx=1024, n_batch=64, n_seq_max=8, n_swa=8, own_copies=True)
    runner, engine = _engine(None, runner=FakeRunner(info=info))
    execute, parked_in_decodes = runner.execute, []

    def watched(items):
        parked_in_decodes.append(len(engine.kv_manager.parked))
        return execute(items)

    runner.execute = watched  # type: ignore[method-assign]
    head = byte_tokenize("a long shared instruction, " * 3)
    first, second, third = (head + byte_tokenize(f" question {i}?") for i in range(3))
    engine.add_request("long", first, sampling(max_tokens=40))
    engine.step()  # its prompt computed: the next one copies from it while it decodes
    engine.add_request("copy", second, sampling(max_tokens=8))
    while engine.has_work:
        engine.step()
        kv = engine.kv_manager
        owners = [*engine.scheduler.running, *kv.parked]
        assert all(kv.blocks.ref_count(b) == 1 for o in owners for b in o.page_table.blocks)
        assert len(kv.parked) == 0
    engine.check_integrity()
    assert parked_in_decodes and not any(parked_in_decodes)
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b)
    assert runner.copies and runner.copies[0][2] == shared
    saved = engine.kv_manager.saved
    assert saved.get(second[: runner.copies[0][2]], "") is not None  # the checkpoint
    restores = saved.snapshot().restores
    tokens, cached = _ask(engine, "third", third)
    # The finished requests' own states are longer and cannot be cut back (the window): the
    # checkpoint serves the prefix.
    assert tokens == _fresh(third) and cached == shared
    assert saved.snapshot().restores == restores + 1
