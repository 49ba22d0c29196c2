"""The engine as a state machine: random traffic, hang-ups and faults never break its books.

Hypothesis drives `LLMEngine` through `AsyncEngine`, the way the server does, with the engine
thread replaced by explicit pumps so every interleaving is reproducible. Rules: submit (prompts
that repeat, share prefixes with or extend earlier ones; n choices as forks; streamed or
answered whole; from one of a few tenants, whose fair shares reorder admission and preempt
running requests, parked to be resumed), abort a waiting request, hang up on a request that
already has tokens, fail the next decode of a running sequence, lose a parked sequence's
sliding window, pump. After every rule the KV ledger is whole and no request has output after
its finish (nor, answered whole, before it); at the end every request has ended and only
parked sequences hold KV.

Oracle: the fake model's next token is a function of everything resident in the sequence, so
a request that ends by length must have exactly the tokens its prompt alone would produce;
stale, shared-wrong or lost KV (prefix reuse, takeover, preemption, cleared ids) shows up here.
Each request belongs to a random cache scope of a few (a key, a salt, the shared ""): it may
report cached tokens only when another request of its own scope began with the same full
block, since the prompts repeat across scopes, a reuse across them would show at once.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import count
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ferrum.engine.async_engine import AsyncEngine, RequestStream
from ferrum.engine.contracts import BatchItem, ModelInfo, StepResult
from ferrum.engine.engine import LLMEngine
from ferrum.engine.kv.tiers import TierConfig
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.request import AdapterSet, ImageSpan, adapter_scope, image_token_ids
from ferrum.engine.speculation.speculator import SpecConfig
from ferrum.errors import TooManyRequests
from tests.factories import (
    BOS,
    FakeRunner,
    count_copies,
    default_next_token,
    fake_engine,
    model_info,
    sampling,
)
from tests.profiles import examples

ALPHABET = [ord(c) for c in "ab c"]  # few symbols: prompts collide and share prefixes often
KINDS = ["fresh", "same", "extend", "branch", "turn"]
# Few tenants for 3 slots: fair admission and preemption for fairness happen all the time.
TENANTS = ["x", "y", "z"]
SCOPES = ["", "key:a", "salt:b"]  # cache scopes: no KV may be reused from another one
_Scope = tuple[str, AdapterSet]  # a request's cache scope and LoRA set


class _PumpedAsyncEngine(AsyncEngine):
    """AsyncEngine whose engine thread is `pump()`: one step of its loop, on the caller's
    thread, followed by what a busy engine does after each step (`_after_step`: commands
    applied, outputs posted).

    Commands, dropped outputs of aborted requests and stream bookkeeping are AsyncEngine's own;
    only the thread and the event loop hop are gone (posting dispatches at once).
    """

    alive = True  # no thread to ask

    def pump(self) -> list[RequestOutput]:
        self._posted: list[RequestOutput] = []
        self._after_step(self.core.step() if self.core.has_work else [])
        return self._posted

    def _post(self, outputs: list[RequestOutput]) -> None:
        self._posted.extend(outputs)
        self._dispatch(self._hold(outputs))

    @property
    def idle(self) -> bool:
        return not self.core.has_work and self._commands.empty()


@dataclass
class _Client:
    """One engine request as its HTTP client sees it."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    stream: RequestStream
    whole: bool = False  # answered whole: one output, the finished one
    scope: str = ""  # its cache scope and its adapter set's (`Request.cache_scope`)
    grammar: str | None = None  # what its output must match (the constrained machine's)
    adapters: AdapterSet = ()
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    hung_up: bool = False

    def read(self) -> None:
        """What the stream holds now; nothing may follow its finished output."""
        q = self.stream._queue  # the SSE generator's view, read without an event loop
        while not q.empty():
            out = q.get_nowait()
            assert not self.hung_up, f"{self.request_id}: output after the client hung up"
            assert self.finish_reason is None, f"{self.request_id}: output after its finish"
            assert out.finished or not self.whole, f"{self.request_id}: a delta, answered whole"
            self.tokens += out.token_ids
            if out.finished:
                self.finish_reason = out.finish_reason


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    history = list(prompt)
    for _ in range(n):
        history.append(default_next_token(history))
    return history[len(prompt) :]


def image_spans(
    prompt: list[int], rows: Callable[[list[int]], np.ndarray]
) -> tuple[ImageSpan, ...]:
    """The prompt's images: each run of image ids (a branch may have cut one short, or put
    two side by side), with `rows` of its ids."""
    out, i = [], 0
    while i < len(prompt):
        j = i
        while j < len(prompt) and prompt[j] < 0:
            j += 1
        if j > i:
            out.append(ImageSpan(i, rows(prompt[i:j])))
        i = j + 1
    return tuple(out)


def machine_settings(max_examples: int) -> settings:
    """Random runs of 50 steps each; slow examples are fine (the pump does real work)."""
    return settings(
        max_examples=examples(max_examples),
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


class EngineMachine(RuleBasedStateMachine):
    """Over the fake runner; subclasses put a real llama.cpp model under the same traffic."""

    bos = BOS
    adapter_sets: tuple[AdapterSet, ...] = ((),)  # the LoRA sets requests draw from
    images: tuple[list[int], ...] = ()  # each image's ids (`image_token_ids`) tails may hold

    def __init__(self) -> None:
        super().__init__()
        self.runner, self.engine = self.make_engine()
        self.front = _PumpedAsyncEngine(self.engine, max_queue=8)
        self.clients: dict[str, _Client] = {}
        # Engine-side news per request, before AsyncEngine drops what hung-up clients miss.
        self.outputs: dict[str, list[RequestOutput]] = {}
        # Every prompt so far, its scope and adapter set.
        self.histories: list[tuple[list[int], _Scope]] = []
        # Prompt + output of requests finished by length, and their scope and adapter set.
        self.turns: list[tuple[list[int], _Scope]] = []
        self.ids = count()
        self.rejected = 0

    def make_engine(self) -> tuple[FakeRunner, LLMEngine]:
        # 16 blocks of 8 positions for 3 running + 3 parked sequences: admission waits,
        # parked sequences get evicted and growing requests get preempted.
        runner = FakeRunner(info=model_info(n_ctx=128, n_batch=24, n_seq_max=6))
        return runner, fake_engine(runner, block_size=8)

    def expected(self, prompt: list[int], n: int) -> list[int]:
        """The oracle: the tokens `prompt` alone gives, greedy, when nothing else runs."""
        return expected_tokens(prompt, n)

    def expected_for(self, prompt: list[int], n: int, got: list[int]) -> list[int]:
        """What `got` must equal: the oracle's tokens (a model with float noise between batch
        shapes may let a near tie go either way; see the sliding-window machine)."""
        return self.expected(prompt, n)

    # -- drawing ----------------------------------------------------------------------------

    def oracle(self, client: _Client, got: list[int]) -> list[int]:
        """What a finished client's tokens must be (`expected_for` its prompt)."""
        return self.expected_for(client.prompt, client.max_tokens, got)

    def _draw_prompt(self, data: st.DataObject) -> tuple[list[int], _Scope | None]:
        """A prompt, and the scope of the earlier one it repeats, extends or branches off
        (None: fresh)."""
        tail = self._draw_tail(data)
        kind = data.draw(st.sampled_from(KINDS), label="kind")
        like: _Scope | None = None
        if kind == "turn" and self.turns:  # a chat's next turn, often still parked
            conversation, like = data.draw(st.sampled_from(self.turns[-3:]), label="conversation")
            prompt = conversation + tail
        elif kind in ("fresh", "turn") or not self.histories:
            prompt = [self.bos, *tail]
        else:
            earlier, like = data.draw(st.sampled_from(self.histories), label="earlier")
            if kind == "same":
                prompt = list(earlier)
            elif kind == "extend":
                prompt = earlier + tail
            else:  # the same beginning, then something else
                cut = data.draw(st.integers(1, len(earlier)), label="cut")
                prompt = earlier[:cut] + tail
        return prompt[: self.engine.max_positions * 3 // 4] or [self.bos], like

    def _draw_tail(self, data: st.DataObject) -> list[int]:
        """Symbols of the alphabet, and whole images where the machine has some."""
        symbols = ALPHABET + [-1 - k for k in range(len(self.images))]
        drawn = data.draw(st.lists(st.sampled_from(symbols), max_size=30), label="tail")
        return [t for s in drawn for t in (self.images[-1 - s] if s < 0 else [s])]

    def spans(self, prompt: list[int]) -> tuple[ImageSpan, ...]:
        return image_spans(prompt, self.image_rows)

    def image_rows(self, ids: list[int]) -> np.ndarray:
        """The rows decoded at these image ids' positions (the fake model reads the ids)."""
        return np.zeros((len(ids), 1), dtype=np.float32)

    def draw_grammar(self, data: st.DataObject) -> str | None:
        """The grammar a submitted request's output must match (none here: free text)."""
        return None

    def _pick(self, data: st.DataObject, ids: list[str]) -> _Client:
        return self.clients[data.draw(st.sampled_from(sorted(ids)), label="request")]

    def _open(self) -> list[_Client]:
        return [c for c in self.clients.values() if c.finish_reason is None and not c.hung_up]

    def _waiting_ids(self) -> list[str]:
        waiting = {r.request_id for r in self.engine.scheduler.waiting}
        return [c.request_id for c in self._open() if c.request_id in waiting]

    def _streaming_ids(self) -> list[str]:
        """Requests whose client has seen tokens, or (answered whole) whose engine has made
        some: a hang-up there drops what the engine holds for it."""
        return [c.request_id for c in self._open() if c.tokens or self.outputs.get(c.request_id)]

    # -- rules ------------------------------------------------------------------------------

    @rule(
        data=st.data(),
        n=st.integers(1, 3),
        max_tokens=st.integers(1, 48),
        whole=st.booleans(),
        tenant=st.sampled_from(TENANTS),
        scope=st.sampled_from(SCOPES),
    )
    def submit(
        self, data: st.DataObject, n: int, max_tokens: int, whole: bool, tenant: str, scope: str
    ) -> None:
        prompt, like = self._draw_prompt(data)
        adapters: AdapterSet = ()
        if len(self.adapter_sets) > 1:
            adapters = data.draw(st.sampled_from(self.adapter_sets), label="adapters")
        if like is not None and data.draw(st.booleans(), label="in the earlier one's scope"):
            scope, adapters = like  # most reuse is within a scope: keep those paths busy
        try:
            self.front.check_capacity(n)
        except TooManyRequests:
            self.rejected += 1
            return
        max_tokens = self.engine.clamp_max_tokens(len(prompt), max_tokens)
        grammar = self.draw_grammar(data)
        marks = self.draw_checkpoints(data, prompt)
        base = f"r{next(self.ids)}"
        for i in range(n):  # n choices: one prompt, n requests that share its prefill
            rid = base if n == 1 else f"{base}-{i}"
            # n choices: one prompt of one tenant, in one cache scope, one grammar, one set;
            # each runs to max_tokens (a real tiny model's end token is a token here, as in
            # the oracles, which decode with ignore_eos; a grammar still ends it)
            params = sampling(
                max_tokens=max_tokens, tenant=tenant, cache_scope=scope, grammar=grammar,
                adapters=adapters, ignore_eos=True,
            )  # fmt: skip
            stream = self.front.submit(
                rid, prompt, params, True, whole, self.spans(prompt), marks
            )
            full = scope + adapter_scope(adapters)
            self.clients[rid] = _Client(
                rid, prompt, max_tokens, stream, whole, full, grammar, adapters
            )
        self.histories.append((prompt, (scope, adapters)))

    # Whether requests carry checkpoint hints (`Request.checkpoints`), as a chat's do.
    checkpoint_hints = False
    checkpoints_kept = 0

    def draw_checkpoints(self, data: st.DataObject, prompt: list[int]) -> tuple[int, ...]:
        """Up to two positions of the prompt where the API would say a client string starts;
        out-of-range ones too, which the engine must ignore."""
        if not self.checkpoint_hints:
            return ()
        marks = st.lists(st.integers(-1, len(prompt) + 2), max_size=2)
        return tuple(data.draw(marks, label="checkpoints"))

    @precondition(lambda self: self._waiting_ids())
    @rule(data=st.data())
    def abort_waiting(self, data: st.DataObject) -> None:
        client = self._pick(data, self._waiting_ids())
        self.front.abort(client.request_id)
        client.hung_up = True

    @precondition(lambda self: self._streaming_ids())
    @rule(data=st.data())
    def hang_up_mid_stream(self, data: st.DataObject) -> None:
        client = self._pick(data, self._streaming_ids())
        self.front.abort(client.request_id)
        client.hung_up = True

    @precondition(lambda self: self.engine.scheduler.running and hasattr(self.runner, "fail_seqs"))
    @rule(data=st.data())
    def fail_next_decode(self, data: st.DataObject) -> None:
        running = sorted(r.seq_id for r in self.engine.scheduler.running)
        self.runner.fail_seqs.add(data.draw(st.sampled_from(running), label="seq"))

    @precondition(lambda self: self.engine.kv_manager.parked and hasattr(self.runner, "fail_seqs"))
    @rule(data=st.data())
    def lose_a_window(self, data: st.DataObject) -> None:
        """A parked sequence's sliding window loses cells (as llama.cpp recycles them): copies
        from it must go to another owner or a fresh prefill, with the books still whole."""
        parked = sorted(p.seq_id for p in self.engine.kv_manager.parked)
        self.runner.lost_windows.add(data.draw(st.sampled_from(parked), label="seq"))

    @rule(times=st.integers(1, 12))
    def pump(self, times: int) -> None:
        for _ in range(times):
            self._pump_once()

    def _pump_once(self) -> None:
        for out in self.front.pump():
            outs = self.outputs.setdefault(out.request_id, [])
            outs.append(out)
            if out.finish_reason == "length":
                tokens = [t for o in outs for t in o.token_ids]
                client = self.clients[out.request_id]
                key_scope = client.scope.removesuffix(adapter_scope(client.adapters))
                self.turns.append((client.prompt + tokens, (key_scope, client.adapters)))
        for client in self.clients.values():
            client.read()

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def ledger_is_whole(self) -> None:
        self.engine.check_integrity()

    @invariant()
    def one_finish_and_nothing_after(self) -> None:
        for rid, outs in self.outputs.items():
            finished = [i for i, o in enumerate(outs) if o.finished]
            assert finished in ([], [len(outs) - 1]), f"{rid}: finishes at {finished}"

    @invariant()
    def kv_is_reused_only_within_a_scope(self) -> None:
        """A reuse needs an owner whose first full block is the request's own (the index
        chains blocks from the first): another request of the same scope, prompt and tokens."""
        bs = self.engine.kv_manager.blocks.block_size
        firsts: Counter[tuple[str, tuple[int, ...]]] = Counter()
        reused = []
        for rid, c in self.clients.items():
            outs = self.outputs.get(rid, [])
            tokens = c.prompt + [t for o in outs for t in o.token_ids]
            if len(tokens) >= bs:
                firsts[c.scope, tuple(tokens[:bs])] += 1
            if any(o.cached_tokens for o in outs):
                reused.append((rid, c.scope, tuple(tokens[:bs])))
        for rid, scope, first in reused:
            assert len(first) == bs and firsts[scope, first] >= 2, f"{rid} reused another scope"

    @invariant()
    def finished_output_is_what_the_prompt_alone_gives(self) -> None:
        for rid, outs in self.outputs.items():
            if not outs[-1].finished or outs[-1].finish_reason in ("abort", "error"):
                continue
            c = self.clients[rid]
            tokens = [t for o in outs for t in o.token_ids]
            assert outs[-1].finish_reason == "length"  # the fake model never stops by itself
            assert tokens == self.oracle(c, tokens), rid
            if not c.hung_up:
                assert c.tokens == tokens and c.finish_reason == "length", rid

    def teardown(self) -> None:
        if isinstance(self.runner, FakeRunner):
            self.runner.fail_seqs.clear()
        for _ in range(2_000):
            if self.front.idle:
                break
            self._pump_once()
        assert self.front.idle, "the engine did not drain"
        self.ledger_is_whole()
        self.finished_output_is_what_the_prompt_alone_gives()
        for rid, client in self.clients.items():
            assert self.outputs[rid][-1].finished, f"{rid} never ended"
            assert client.hung_up or client.finish_reason is not None, f"{rid}: no finish seen"
        assert not self.front._streams, "streams left behind"
        assert not self.front._held, "held outputs left behind"
        kv = self.engine.kv_manager
        used = kv.blocks.num_blocks - kv.blocks.num_free
        assert used == kv.parked.num_blocks, "blocks held outside parked sequences"
        kv.drop_parked()
        self.engine.check_integrity()
        assert kv.blocks.num_free == kv.blocks.num_blocks
        assert kv.seq_ids.num_free == kv.seq_ids.size
        if isinstance(self.runner, FakeRunner):
            assert not self.runner.samplers, "samplers left behind"


EngineMachine.TestCase.settings = machine_settings(200)
TestEngineStateMachine = pytest.mark.slow(EngineMachine.TestCase)


class SpeculatingEngineMachine(EngineMachine):
    """The same traffic with guesses on every decode (right, wrong at a random position, or
    half right): the output must still be what the prompt alone gives, token for token, and
    no rolled-back position may stay in a sequence, be indexed or be parked."""

    def make_engine(self) -> tuple[FakeRunner, LLMEngine]:
        from tests.unit.test_speculation import OracleDrafter

        runner = FakeRunner(info=model_info(n_ctx=128, n_batch=24, n_seq_max=6))
        rng = random.Random(0)
        engine = LLMEngine(
            runner, block_size=8, max_running=3,
            speculation=SpecConfig(draft_max=4, batch_max=8),
            drafter=lambda _: OracleDrafter(rng, runner.next_token),
        )  # fmt: skip
        return runner, engine

    @invariant()
    def parked_sequences_hold_only_their_tokens(self) -> None:
        for parked in self.engine.kv_manager.parked:
            assert len(self.runner.kv[parked.seq_id]) == len(parked.all_token_ids)


SpeculatingEngineMachine.TestCase.settings = machine_settings(100)
TestSpeculatingEngineStateMachine = pytest.mark.slow(SpeculatingEngineMachine.TestCase)


class DecodeEveryEngineMachine(SpeculatingEngineMachine):
    """The speculating traffic with `--decode-every 3`: streams sit out two of every three
    steps that compute a running prompt. Only timing changes: the same oracles, and every
    request still ends (a step with no prompt chunk to compute decodes the streams)."""

    def make_engine(self) -> tuple[FakeRunner, LLMEngine]:
        runner, engine = super().make_engine()
        engine.scheduler.decode_every = 3
        return runner, engine


DecodeEveryEngineMachine.TestCase.settings = machine_settings(100)
TestDecodeEveryEngineStateMachine = pytest.mark.slow(DecodeEveryEngineMachine.TestCase)


class NgramEngineMachine(SpeculatingEngineMachine):
    """The same traffic with the real n-gram drafter: guesses from each request's own tokens
    and from the requests finished before it (the traffic repeats earlier prompts and
    conversations), right or wrong as they come, each only where it pays for its position."""

    def make_engine(self) -> tuple[FakeRunner, LLMEngine]:
        # Decodes timed as 2 CPU cores time them: the guesses must also pay (Speculator.paying).
        # ngram_min 2: once decodes are timed, one-token matches are looked up too and their
        # own rate decides, so guesses from every match length meet random traffic.
        runner = FakeRunner(info=model_info(n_ctx=128, n_batch=24, n_seq_max=6),
                            decode_cost=(0.006, 0.005))  # fmt: skip
        spec = SpecConfig(draft_max=4, batch_max=8, ngram_min=2, ngram_max=4)
        return runner, LLMEngine(runner, block_size=8, max_running=3, speculation=spec)


NgramEngineMachine.TestCase.settings = machine_settings(100)
TestNgramEngineStateMachine = pytest.mark.slow(NgramEngineMachine.TestCase)


class TieredEngineMachine(EngineMachine):
    """The same traffic with every evicted sequence saved to a RAM tier of a few entries and
    a disk tier behind it, restored (whole or cut back) instead of recomputed, and restarts on
    the same folder whenever the engine is idle: the output must still be what the prompt alone
    gives, and the index must hold exactly the running, parked and saved sequences."""

    folder: Path | None = None
    info: dict[str, object] = {}  # the fake model's settings (`model_info`)

    def make_engine(self) -> tuple[FakeRunner, LLMEngine]:
        from tests.unit.test_tiers import AlwaysRestore

        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="ferrum-tiers-"))
        runner = FakeRunner(info=self.model())
        # A fake state is 4 bytes a position: RAM holds two or three, the disk a dozen.
        tiers = TierConfig(400, 2_000, self.folder, "fake", io_thread=False)
        engine = LLMEngine(runner, block_size=8, max_running=3, tiers=tiers)
        assert engine.kv_manager.saved is not None
        engine.kv_manager.saved.costs = AlwaysRestore()
        return runner, engine

    def model(self) -> ModelInfo:
        return model_info(n_ctx=128, n_batch=24, n_seq_max=6, **self.info)

    @precondition(lambda self: self.front.idle)
    @rule()
    def restart(self) -> None:
        self.engine.shutdown()
        self.runner, self.engine = self.make_engine()
        self.front = _PumpedAsyncEngine(self.engine, max_queue=8)

    @invariant()
    def tiers_stay_in_bounds(self) -> None:
        saved = self.engine.kv_manager.saved
        assert saved is not None
        stats = saved.snapshot()
        assert stats.ram.bytes <= 400 + saved.pinned_bytes and stats.disk.bytes <= 2_000
        assert stats.failures == 0
        for entry in saved:
            assert entry.data is not None or entry.header is not None
            assert entry in self.engine.kv_manager.index

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)


TieredEngineMachine.TestCase.settings = machine_settings(100)
TestTieredEngineStateMachine = pytest.mark.slow(TieredEngineMachine.TestCase)


class OwnCopiesEngineMachine(TieredEngineMachine):
    """The tiered traffic on a model whose window cache is sized to the windows (Gemma 3's
    default): every prefix copy takes cells of its own and leaves a checkpoint in the tiers,
    and a finished sequence goes to the tiers instead of parking. Same oracles."""

    info = {"n_swa": 8, "own_copies": True}
    decodes_beside_parked = 0
    checkpoint_hints = True

    def make_engine(self) -> tuple[FakeRunner, LLMEngine]:
        runner, engine = super().make_engine()
        assert engine.kv_manager.own_copies
        execute = runner.execute

        def checked(items):
            if engine.kv_manager.parked.num_blocks:
                type(self).decodes_beside_parked += 1
            return execute(items)

        runner.execute = checked  # type: ignore[method-assign]
        return runner, engine

    @invariant()
    def nothing_shared_nothing_parked(self) -> None:
        kv = self.engine.kv_manager
        owners = [*self.engine.scheduler.running, *kv.parked]
        for table in (owner.page_table for owner in owners):
            assert all(kv.blocks.ref_count(b) == 1 for b in table.blocks), "a shared block"
        assert self.decodes_beside_parked == 0, "a decode ran beside a parked sequence"
        assert len(kv.parked) == 0, "a finished sequence parked"

    def teardown(self) -> None:
        checkpoints = self.engine.kv_manager.checkpoints
        assert checkpoints is not None
        type(self).checkpoints_kept += checkpoints.kept
        super().teardown()


@pytest.mark.slow
def test_own_copies_engine_state_machine() -> None:
    case = OwnCopiesEngineMachine.TestCase()
    case.settings = machine_settings(100)
    case.runTest()
    assert OwnCopiesEngineMachine.checkpoints_kept > 0  # the hints were acted on


class StreamsEngineMachine(TieredEngineMachine):
    """The tiered traffic with a cell stream per sequence id (--kv-streams): six streams of
    128 cells, every prefix copy into cells of its own, finished sequences parked in their
    own stream and never bounded. Same oracles."""

    copies = 0

    def model(self) -> ModelInfo:
        return model_info(n_ctx=768, n_ctx_seq=128, kv_streams=True, n_batch=24, n_seq_max=6)

    def make_engine(self) -> tuple[FakeRunner, LLMEngine]:
        runner, engine = super().make_engine()
        assert engine.kv_manager.streams and engine.max_positions == 128
        count_copies(runner, self.copied)
        return runner, engine

    def copied(self, length: int) -> None:
        type(self).copies += 1

    @invariant()
    def nothing_shared_no_table_beyond_a_stream(self) -> None:
        kv = self.engine.kv_manager
        for owner in [*self.engine.scheduler.running, *kv.parked]:
            blocks = owner.page_table.blocks
            assert all(kv.blocks.ref_count(b) == 1 for b in blocks), "a shared block"
            assert len(blocks) <= kv.blocks.seq_blocks, "a sequence beyond its stream"


@pytest.mark.slow
def test_streams_engine_state_machine() -> None:
    case = StreamsEngineMachine.TestCase()
    case.settings = machine_settings(100)
    case.runTest()
    assert StreamsEngineMachine.copies > 0


# The fake LoRA model: a cell computed under adapter set k holds its token + k × _SET_CODE,
# so the next token depends on the adapters every resident cell was computed with. A prefix
# reused across sets, or a decode under the wrong set, changes the output at once.
_SET_CODE = 1_000
_SETS: tuple[AdapterSet, ...] = ((), ((0, 1.0),), ((1, 0.5),), ((0, 0.25), (1, 2.0)))


class _LoraRunner(FakeRunner):
    def execute(self, items: Sequence[BatchItem]) -> StepResult:
        coded = [
            replace(i, tokens=[t + _SET_CODE * _SETS.index(i.adapters) for t in i.tokens])
            for i in items
        ]
        return super().execute(coded)  # refuses a decode that mixes sets


class LoraEngineMachine(EngineMachine):
    """The same traffic over two adapters, both at once and the base: every request's output
    is what its prompt alone gives under its own set (the oracle computes every cell under
    that set), no decode mixes sets (the runner refuses it), and a request reports cached
    tokens only when one of its own scope and set began the same way."""

    adapter_sets = _SETS

    def make_engine(self) -> tuple[FakeRunner, LLMEngine]:
        runner = _LoraRunner(info=model_info(n_ctx=128, n_batch=24, n_seq_max=6))
        return runner, fake_engine(runner, block_size=8)

    def oracle(self, client: _Client, got: list[int]) -> list[int]:
        code = _SET_CODE * _SETS.index(client.adapters)
        history = [t + code for t in client.prompt]
        for _ in range(client.max_tokens):
            history.append(default_next_token(history) + code)
        return [t - code for t in history[len(client.prompt) :]]


LoraEngineMachine.TestCase.settings = machine_settings(150)
TestLoraEngineStateMachine = pytest.mark.slow(LoraEngineMachine.TestCase)


# Image runs of 5, 9 and 12 positions: with blocks of 8 they start, end and straddle blocks.
_IMAGES = tuple(image_token_ids(bytes([k]), n) for k, n in enumerate((5, 9, 12)))


class ImageEngineMachine(TieredEngineMachine):
    """The same traffic with images in the prompts (their ids, drawn from their pixels, are
    what the fake model reads), through parking, the RAM and disk tiers and restarts: the
    output is what the prompt alone gives, so no image is ever served another's KV, and a
    reuse that a branch cut inside an image stops at the image's start."""

    images = _IMAGES

    @invariant()
    def no_reuse_ends_inside_an_image(self) -> None:
        for rid, outs in self.outputs.items():
            cached = outs[-1].cached_tokens
            for span in self.spans(self.clients[rid].prompt):
                assert not span.start < cached < span.end, f"{rid} reused part of an image"


ImageEngineMachine.TestCase.settings = machine_settings(100)
TestImageEngineStateMachine = pytest.mark.slow(ImageEngineMachine.TestCase)


class ImageNgramEngineMachine(NgramEngineMachine):
    """Images under n-gram speculation: a guess copied from a prompt stops before an
    image's ids (the fake runner refuses an id < 0 where no image row is decoded)."""

    images = _IMAGES


ImageNgramEngineMachine.TestCase.settings = machine_settings(60)
TestImageNgramEngineStateMachine = pytest.mark.slow(ImageNgramEngineMachine.TestCase)
