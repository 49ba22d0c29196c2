"""The embedding engine: all-MiniLM-L6-v2 through `EmbeddingRunner` and `EmbeddingEngine`
against the numpy reference, batching across concurrent requests, cancellation, the queue
bound and bad inputs; a decoder model (the tiny Llama) embedding with chosen pooling; and the
batching rule on a fake runner (first come first served, limits, failures kept to their batch).

Oracles: each vector == the reference (cosine ≥ 0.999); an input embeds the same alone as in a
crowd; on a causal model "last" pooling == the last token's hidden state ("none"), and "cls"
pooling of a text == its first token alone.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections.abc import Sequence

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrum.engine.embedding import POOLINGS, EmbeddingEngine, EmbeddingInfo
from ferrum.engine.llama.embedding_runner import _POOLING_TYPES, EmbeddingRunner
from ferrum.errors import EngineError, InvalidRequest, ModelLoadError, TooManyRequests
from tests.embedding_model import reference_embeddings, write_minilm_gguf
from tests.profiles import examples

TEXTS = [
    "A man is eating food.",
    "Hi",
    "Hello, world! How are you -- really?! (I'd like to know...)",
    "Café naïve résumé: Ünïcödé façade, Straße, Привет мир.",
    "In 2024, 3.14159 × 2 = 6.28318; the price rose 12% to $1,234.56.",
    "  leading,  doubled   spaces\tand\ttabs\nand newlines  ",
    "emoji 🙂 and symbols ~ ^ | < > © → ∞ antidisestablishmentarianism",
    "The slide rule and the abacus came first; electronic machines came later still, "
    "and with them the stored program, the compiler and the operating system.",
]
MAX_SEQS = 16


def unit(vectors: Sequence[np.ndarray]) -> np.ndarray:
    v = np.array(vectors)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def serve(runner, body, **kwargs):
    """Runs `body(engine)` on a fresh event loop with an engine started on it."""

    async def main():
        engine = EmbeddingEngine(runner, **kwargs)
        engine.start()
        try:
            return await body(engine)
        finally:
            await engine.stop()
            assert not engine.alive

    return asyncio.run(main())


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


class Gate:
    """An on_batch observer that records each decode and holds the engine thread in the
    first one until `open()`: what is submitted meanwhile waits in the queue."""

    def __init__(self):
        self.batches: list[tuple[int, int]] = []
        self._open = threading.Event()

    def __call__(self, inputs: int, tokens: int, seconds: float) -> None:
        self.batches.append((inputs, tokens))
        self._open.wait(timeout=10)

    def open(self) -> None:
        self._open.set()


@pytest.fixture(scope="session")
def minilm_gguf(tmp_path_factory) -> str:
    return str(write_minilm_gguf(tmp_path_factory.mktemp("models") / "all-minilm-l6-v2.gguf"))


@pytest.fixture(scope="module")
def minilm(minilm_gguf):
    runner = EmbeddingRunner(minilm_gguf, threads=1, batch_tokens=1024, max_seqs=MAX_SEQS)
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture(scope="module")
def tokens(minilm) -> list[list[int]]:
    return [minilm.vocab.tokenize(t, True, False) for t in TEXTS]


@pytest.fixture(scope="module")
def alone(minilm, tokens) -> np.ndarray:
    """Each text embedded in a decode of its own (unit length)."""
    return unit([minilm.embed_batch([t])[0] for t in tokens])


# -- the runner --------------------------------------------------------------------------------


def test_minilm_info(minilm):
    info = minilm.info
    assert (info.n_embd, info.pooling, info.architecture) == (384, "mean", "bert")
    assert not info.causal
    assert info.max_tokens == 512  # n_ctx_train: BERT's learned positions end there
    assert (info.n_batch, info.n_seq_max, info.n_vocab) == (1024, MAX_SEQS, 30522)
    assert set(_POOLING_TYPES) == set(POOLINGS)


def test_the_runner_refuses_what_would_abort_llama_cpp(minilm, tokens):
    cls = tokens[0][0]
    with pytest.raises(ValueError):
        minilm.embed_batch([[cls] * 513])  # position 512 aborts the process in llama.cpp
    with pytest.raises(ValueError):
        minilm.embed_batch([tokens[1]] * (MAX_SEQS + 1))
    with pytest.raises(ValueError):
        minilm.embed_batch([[cls] * 400] * 3)  # 1200 tokens > n_batch
    with pytest.raises(ValueError):
        minilm.embed_batch([[]])
    assert len(minilm.embed_batch([[cls] * 512])) == 1  # the longest input still embeds


def test_a_short_batch_budget_caps_the_longest_input(minilm_gguf):
    runner = EmbeddingRunner(minilm_gguf, threads=1, batch_tokens=256, max_seqs=4)
    try:
        assert (runner.info.max_tokens, runner.info.n_batch) == (256, 256)
    finally:
        runner.close()
        runner.close()  # idempotent


def test_models_that_cannot_embed_so_are_refused(minilm_gguf, tmp_path):
    with pytest.raises(ModelLoadError, match="classification head"):
        EmbeddingRunner(minilm_gguf, threads=1, pooling="rank")
    with pytest.raises(ModelLoadError, match="not found"):
        EmbeddingRunner(str(tmp_path / "missing.gguf"), threads=1)
    with pytest.raises(ValueError, match="pooling"):
        EmbeddingRunner(minilm_gguf, threads=1, pooling="max")


def _reranker_head(n_embd: int = 384) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "cls.weight": rng.normal(0, 0.05, (n_embd, n_embd)).astype(np.float32),
        "cls.bias": rng.normal(0, 0.05, n_embd).astype(np.float32),
        "cls.output.weight": rng.normal(0, 0.5, (2, n_embd)).astype(np.float32),
        "cls.output.bias": np.array([0.25, -0.5], dtype=np.float32),
    }


class _RerankerWriter(gguf.GGUFWriter):
    """MiniLM with a (random) classification head of two outputs: a cross-encoder's shape."""

    def add_pooling_type(self, value: gguf.PoolingType) -> None:
        super().add_pooling_type(gguf.PoolingType.RANK)
        self.add_classifier_output_labels(["yes", "no"])
        for name, array in _reranker_head().items():
            self.add_tensor(name, array)


def test_rank_pooling_gives_the_classifier_outputs(minilm_gguf, tmp_path, tokens):
    """BERT's rerank head in llama.cpp: W_out · tanh(W · h_cls + b) + b_out, where h_cls is
    what "cls" pooling returns from the same weights."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFWriter", _RerankerWriter)  # the converter writes through it
        path = str(write_minilm_gguf(tmp_path / "reranker.gguf"))
    reranker = EmbeddingRunner(path, threads=1, batch_tokens=512, max_seqs=8)
    cls = EmbeddingRunner(minilm_gguf, threads=1, batch_tokens=512, max_seqs=8, pooling="cls")
    try:
        assert (reranker.info.pooling, reranker.info.n_embd) == ("rank", 2)
        scores = np.array(reranker.embed_batch(tokens[:4]))
        head = _reranker_head()
        h = np.array(cls.embed_batch(tokens[:4]))
        hidden = np.tanh(h @ head["cls.weight"].T + head["cls.bias"])
        expected = hidden @ head["cls.output.weight"].T + head["cls.output.bias"]
        assert scores.shape == (4, 2)
        np.testing.assert_allclose(scores, expected, rtol=1e-3, atol=1e-3)
    finally:
        reranker.close()
        cls.close()


# -- the engine on MiniLM -------------------------------------------------------------------


def test_concurrent_requests_match_the_reference_in_input_order(minilm, tokens):
    async def body(engine):
        parts = [tokens[:3], tokens[3:5], tokens[5:]]
        return await asyncio.gather(*(engine.embed(p) for p in parts))

    answers = serve(minilm, body)
    vectors = [v for answer in answers for v in answer]
    assert [len(a) for a in answers] == [3, 2, 3]
    assert all(v.shape == (384,) and v.dtype == np.float32 for v in vectors)
    # Raw pooled vectors: normalising is the API's choice.
    assert not np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    cosines = np.sum(unit(vectors) * reference_embeddings(TEXTS), axis=1)
    assert cosines.min() >= 0.999, dict(zip(TEXTS, cosines.round(6), strict=True))


def test_an_input_embeds_the_same_alone_and_in_a_crowd(minilm, tokens, alone):
    crowd = [tokens[(i * 5) % len(tokens)] for i in range(MAX_SEQS - 1)] + [tokens[7]]

    async def body(engine):
        return await engine.embed(crowd), await engine.embed([tokens[7]])

    in_crowd, by_itself = serve(minilm, body)
    assert float(unit(in_crowd)[-1] @ unit(by_itself)[0]) >= 0.9999
    cosines = np.sum(unit(in_crowd) * alone[[(i * 5) % 8 for i in range(MAX_SEQS - 1)] + [7]], 1)
    assert cosines.min() >= 0.9999, cosines


def test_fifty_concurrent_requests_are_all_answered_and_batched_together(minilm, tokens, alone):
    rng = random.Random(7)
    requests = [[rng.randrange(len(tokens)) for _ in range(rng.randint(1, 5))] for _ in range(50)]
    batches: list[tuple[int, int, float]] = []

    async def body(engine):
        return await asyncio.gather(*(engine.embed([tokens[i] for i in r]) for r in requests))

    answers = serve(minilm, body, on_batch=lambda *b: batches.append(b))
    for request, answer in zip(requests, answers, strict=True):
        assert np.sum(unit(answer) * alone[request], axis=1).min() >= 0.9999
    sizes = [inputs for inputs, _, _ in batches]
    assert sum(sizes) == sum(map(len, requests))
    assert max(sizes) > 5, sizes  # more inputs than any one request has: shared decodes
    assert max(sizes) <= MAX_SEQS and max(t for _, t, _ in batches) <= minilm.info.n_batch
    assert all(seconds > 0 for _, _, seconds in batches)


def test_a_cancelled_request_is_dropped_before_it_runs(minilm, tokens):
    gate = Gate()

    async def body(engine):
        first = asyncio.create_task(engine.embed([tokens[0]]))
        await until(lambda: gate.batches)  # decoded; the engine thread is held in on_batch
        cancelled = asyncio.create_task(engine.embed(tokens[1:4]))
        await asyncio.sleep(0.01)  # queued behind the held thread
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        gate.open()
        await first
        await engine.embed([tokens[4]])
        return engine.stats()

    stats = serve(minilm, body, on_batch=gate)
    assert gate.batches == [(1, len(tokens[0])), (1, len(tokens[4]))]
    assert (stats.requests, stats.inputs, stats.dropped_inputs) == (2, 2, 3)


def test_more_inputs_waiting_than_the_queue_bound_are_refused(minilm, tokens):
    gate = Gate()

    async def body(engine):
        first = asyncio.create_task(engine.embed([tokens[0]]))
        await until(lambda: gate.batches)
        second = asyncio.create_task(engine.embed(tokens[1:4]))  # 1 + 3 = the bound
        await asyncio.sleep(0.01)
        with pytest.raises(TooManyRequests):
            await engine.embed([tokens[4]])
        with pytest.raises(InvalidRequest, match="at most 4 inputs"):
            await engine.embed(tokens[:5])  # more than the bound alone: never, not later
        gate.open()
        answers = await first, await second
        return answers, await engine.embed(tokens[4:8])  # room again once answered

    (first, second), later = serve(minilm, body, max_queue_inputs=4, on_batch=gate)
    assert (len(first), len(second), len(later)) == (1, 3, 4)


def test_bad_inputs_are_refused_and_the_engine_keeps_serving(minilm, tokens, alone):
    cls = tokens[0][0]

    async def body(engine):
        with pytest.raises(InvalidRequest) as long:
            await engine.embed([tokens[0], [cls] * (engine.info.max_tokens + 1)])
        assert long.value.code == "context_length_exceeded" and long.value.param == "input[1]"
        with pytest.raises(InvalidRequest):
            await engine.embed([[]])
        bad_id, good = await asyncio.gather(
            engine.embed([tokens[1], [cls, engine.info.n_vocab]]),
            engine.embed([tokens[2]]),
            return_exceptions=True,
        )
        assert isinstance(bad_id, InvalidRequest) and "vocabulary" in bad_id.message
        assert engine.alive
        return good, await engine.embed([tokens[3]])

    good, later = serve(minilm, body)
    assert float(unit(good)[0] @ alone[2]) >= 0.9999
    assert float(unit(later)[0] @ alone[3]) >= 0.9999


# -- a decoder model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_runners(tiny_llama):
    runners = {
        p: EmbeddingRunner(tiny_llama, threads=1, batch_tokens=256, max_seqs=8, pooling=p)
        for p in ("mean", "last", "none", "cls")
    }
    try:
        yield runners
    finally:
        for r in runners.values():
            r.close()


def test_a_decoder_model_embeds_batch_invariant(tiny_runners):
    runner = tiny_runners["mean"]
    info = runner.info
    assert (info.pooling, info.causal, info.architecture) == ("mean", True, "llama")
    assert info.max_tokens == info.n_batch == 256
    texts = ["hello world", "a", "the quick brown fox jumps over the lazy dog " * 5, "ünï ✓"]
    inputs = [runner.vocab.tokenize(t, True, False) for t in texts]
    batched = runner.embed_batch(inputs)
    again = runner.embed_batch(inputs)  # the KV memory was cleared between the two
    alone = [runner.embed_batch([t])[0] for t in inputs]
    assert all(v.shape == (info.n_embd,) and np.isfinite(v).all() for v in batched)
    np.testing.assert_allclose(batched, again, rtol=1e-5, atol=1e-6)
    assert np.sum(unit(batched) * unit(alone), axis=1).min() >= 0.9999


def test_decoder_pooling_oracles(tiny_runners):
    """Causal attention: the last token's hidden state is "last" pooling, and a text's first
    token sees only itself, so "cls" pooling of the text == any pooling of that token alone."""
    vocab = tiny_runners["mean"].vocab
    # No BOS: every input then starts with a different token, so "cls" has something to tell.
    inputs = [vocab.tokenize(t, False, False) for t in ("hello world", "x y z", "ab")]
    assert len({t[0] for t in inputs}) == 3

    def embed(pooling, xs):
        return np.array(tiny_runners[pooling].embed_batch(xs))

    last = embed("last", inputs)
    np.testing.assert_allclose(last, embed("none", inputs), atol=1e-5)
    cls = embed("cls", inputs)
    np.testing.assert_allclose(cls, embed("last", [t[:1] for t in inputs]), atol=1e-5)
    assert np.abs(cls - last).max() > 0.1 and np.abs(cls[0] - cls[1]).max() > 0.1  # not vacuous


def test_a_decoder_model_through_the_engine(tiny_runners):
    runner = tiny_runners["mean"]
    inputs = [runner.vocab.tokenize(f"text number {i}", True, False) for i in range(20)]

    async def body(engine):
        return await asyncio.gather(*(engine.embed(inputs[i : i + 3]) for i in range(0, 20, 3)))

    vectors = [v for answer in serve(runner, body) for v in answer]
    alone = [runner.embed_batch([t])[0] for t in inputs]
    assert np.sum(unit(vectors) * unit(alone), axis=1).min() >= 0.9999


# -- the batching rule on a fake runner ---------------------------------------------------


class FakeRunner:
    """Vectors computed from the tokens; any input holding POISON fails its whole decode;
    the first decode waits for `release` when `hold` is set."""

    POISON = 999

    def __init__(self, n_batch: int = 8, n_seq_max: int = 4, hold: bool = False):
        self.info = EmbeddingInfo(
            n_embd=3, max_tokens=n_batch, pooling="mean", architecture="fake", description="",
            n_vocab=1000, n_batch=n_batch, n_seq_max=n_seq_max,
        )  # fmt: skip
        self.vocab = None
        self.batches: list[list[list[int]]] = []
        self.release = threading.Event()
        if not hold:
            self.release.set()

    @staticmethod
    def vector(tokens: Sequence[int]) -> np.ndarray:
        return np.array([sum(tokens), len(tokens), tokens[0]], dtype=np.float32)

    def embed_batch(self, inputs):
        self.batches.append(list(inputs))  # the callers' own lists: identity tells them apart
        self.release.wait(timeout=10)
        if len(inputs) > self.info.n_seq_max or sum(map(len, inputs)) > self.info.n_batch:
            raise ValueError("over the limits")
        if any(self.POISON in t for t in inputs):
            raise EngineError("llama_decode=-1")
        return [self.vector(t) for t in inputs]


def test_a_failed_decode_fails_only_the_requests_in_it():
    runner = FakeRunner(n_batch=8, n_seq_max=4, hold=True)
    requests = {
        "r0": [[1]],
        "r1": [[2, 2], [FakeRunner.POISON], [6] * 6],  # its third input would be decode 3's
        "r2": [[3]],
        "r3": [[4] * 7],
    }

    async def body(engine):
        r0 = asyncio.create_task(engine.embed(requests["r0"]))
        await until(lambda: runner.batches)
        rest = [asyncio.create_task(engine.embed(requests[k])) for k in ("r1", "r2", "r3")]
        await asyncio.sleep(0.01)
        runner.release.set()
        return await asyncio.gather(r0, *rest, return_exceptions=True)

    r0, r1, r2, r3 = serve(runner, body)
    assert isinstance(r1, EngineError)
    for answer, name in ((r0, "r0"), (r2, "r2"), (r3, "r3")):
        np.testing.assert_array_equal(answer, [FakeRunner.vector(t) for t in requests[name]])
    # First come first served, never split, never overtaken: r1's 6-token input opened
    # decode 3 and was dropped with its request; r2 did not jump into decode 2.
    assert runner.batches == [[[1]], [[2, 2], [999]], [[3], [4] * 7]]


def _random_traffic(requests, cancel, busy_chat: bool):
    """Submits `requests` in order (the first decode held until all are in), cancels those
    in `cancel`, and serves them beside a chat party that holds 3 ms turns all along when
    `busy_chat`; checks that each is answered as if alone, in arrival order, within the
    runner's limits. Returns the runner and the stats."""
    from ferrum.engine.turns import Turns

    runner = TimedRunner([], n_batch=16, n_seq_max=5, hold=True)
    turns = Turns()
    chat, stop_chat = turns.join("chat"), threading.Event()

    def chat_steps() -> None:
        while not stop_chat.is_set():
            with chat.turn():
                time.sleep(0.003)

    chat_thread = threading.Thread(target=chat_steps)
    if busy_chat:
        chat_thread.start()

    async def body(engine):
        tasks = [asyncio.create_task(engine.embed(r)) for r in requests]
        await asyncio.sleep(0)  # every request submitted, in order; the first decode held
        for i in cancel:
            tasks[i].cancel()
        runner.release.set()
        return await asyncio.gather(*tasks, return_exceptions=True), engine.stats()

    try:
        answers, stats = serve(runner, body, turns=turns.join("embeddings"))
    finally:
        stop_chat.set()
        if chat_thread.is_alive():
            chat_thread.join(5)
    arrival = {id(t): (i, j) for i, r in enumerate(requests) for j, t in enumerate(r)}
    decoded = [arrival[id(t)] for batch in runner.batches for t in batch]
    assert decoded == sorted(set(decoded))  # arrival order, each input at most once
    # ... or dropped, not both; a request cancelled before the engine took it in is neither.
    kept = sum(len(r) for i, r in enumerate(requests) if i not in cancel)
    assert kept <= len(decoded) + stats.dropped_inputs <= len(arrival)
    for i, (request, answer) in enumerate(zip(requests, answers, strict=True)):
        ran = [j for r, j in decoded if r == i]
        if i in cancel and isinstance(answer, asyncio.CancelledError):
            assert ran == list(range(len(ran)))  # what ran before the cancel, then nothing
            continue
        assert ran == list(range(len(request)))
        np.testing.assert_array_equal(answer, [FakeRunner.vector(t) for t in request])
    assert all(len(b) <= 5 and sum(map(len, b)) <= 16 for b in runner.batches)
    return runner, stats


@pytest.mark.parametrize("beside", ["alone", "a busy chat engine"])
def test_random_traffic_is_answered_as_alone_in_arrival_order_within_limits(beside):
    """Also with a chat engine taking 3 ms turns at the cores all along: a share of its turn
    is less than the fake's 2 ms fixed cost of a decode, so decodes are cut to one input,
    and nothing else may change."""
    rng = random.Random(3)
    requests = [
        [[rng.randrange(900) for _ in range(rng.randint(1, 16))] for _ in range(rng.randint(1, 6))]
        for _ in range(200)
    ]
    cancel = set(rng.sample(range(200), 20))
    runner, stats = _random_traffic(requests, cancel, busy_chat=beside != "alone")
    assert stats.dropped_inputs > 0
    single = sum(len(b) == 1 for b in runner.batches[8:]) / len(runner.batches[8:])
    if beside == "alone":
        assert single < 0.7  # most decodes hold several inputs ...
    else:
        assert single > 0.95  # ... unless a chat engine is busy


_TOKENS = st.lists(st.integers(0, 899), min_size=1, max_size=16)


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(st.lists(_TOKENS, min_size=1, max_size=4), min_size=1, max_size=10),
    cancel=st.sets(st.integers(0, 9), max_size=3),
    busy_chat=st.booleans(),
)
def test_turns_change_no_answer_under_hypothesis_traffic(requests, cancel, busy_chat):
    """The oracle with the turns on and off: whatever the traffic, with or without a chat
    engine holding turns beside it, every request is answered as if alone (cut batches
    change which decode an input rides in, never its vector)."""
    _random_traffic(requests, {i for i in cancel if i < len(requests)}, busy_chat)


class TimedRunner(FakeRunner):
    """A FakeRunner whose decode costs 2 ms + 0.25 ms a token, and which logs its decodes'
    (start, end, tokens)."""

    def __init__(self, log: list[tuple[str, float, float, int]], **kw):
        super().__init__(**kw)
        self.log = log

    def embed_batch(self, inputs):
        start = time.monotonic()
        tokens = sum(map(len, inputs))
        time.sleep(0.002 + 0.00025 * tokens)
        vectors = super().embed_batch(inputs)
        self.log.append(("embed", start, time.monotonic(), tokens))
        return vectors


def test_a_flood_of_embeddings_takes_turns_with_chat_steps_cut_to_a_share():
    """One chat engine (20 ms steps) and one embedding engine share the cores' turns: no two
    decodes overlap; while the chat engine is busy each embedding decode is cut to about
    TURN_SHARE of a chat step, and the two alternate (neither starves); alone, the
    embeddings fill their batches again."""
    from ferrum.engine.async_engine import AsyncEngine
    from ferrum.engine.embedding import TURN_SHARE
    from ferrum.engine.turns import Turns
    from tests.factories import FakeRunner as ChatRunner
    from tests.factories import byte_tokenize, fake_engine, sampling

    log: list[tuple[str, float, float, int]] = []

    class TimedChat(ChatRunner):
        def execute(self, items):
            start = time.monotonic()
            result = super().execute(items)
            log.append(("chat", start, time.monotonic(), 0))
            return result

    turns = Turns()
    embedder = TimedRunner(log, n_batch=256, n_seq_max=64)
    rng = random.Random(5)
    flood = [[[rng.randrange(1, 900) for _ in range(rng.randint(4, 12))]] for _ in range(400)]

    async def main():
        chat = AsyncEngine(fake_engine(TimedChat(step_delay_s=0.02)), turns=turns.join("chat"))
        embeddings = EmbeddingEngine(embedder, turns=turns.join("minilm"))
        chat.start()
        embeddings.start()
        try:
            streams = [
                chat.submit(f"c{i}", byte_tokenize(f"story {i}"), sampling(max_tokens=100), True)
                for i in range(4)
            ]

            async def drain(stream):
                async for out in stream:
                    if out.finished:
                        return time.monotonic()

            chat_done = asyncio.gather(*(drain(s) for s in streams))
            answers = await asyncio.gather(*(embeddings.embed(x) for x in flood))
            chat_end = max(await chat_done)
            await asyncio.sleep(0.3)  # the chat engine no longer counts as busy
            alone = await asyncio.gather(*(embeddings.embed(x) for x in flood[:200]))
        finally:
            await embeddings.stop()
            await chat.stop()
        return answers, alone, chat_end

    answers, alone, chat_end = asyncio.run(main())
    for request, answer in zip(flood + flood[:200], answers + alone, strict=True):
        np.testing.assert_array_equal(answer, [FakeRunner.vector(t) for t in request])
    spans = sorted(log, key=lambda e: e[1])
    for (_, _, end, _), (_, start, _, _) in itertools.pairwise(spans):
        assert start >= end - 1e-4, "two decodes overlapped"
    chat_steps = [e for e in spans if e[0] == "chat"]
    chat_step_s = float(np.median([end - start for _, start, end, _ in chat_steps]))
    busy = (chat_steps[3][1], chat_steps[-4][1])
    during = [e for e in spans if e[0] == "embed" and busy[0] < e[1] < busy[1]]
    steps_during = [e for e in chat_steps if busy[0] < e[1] < busy[1]]
    # First asked, first served: the embeddings get about every other turn, not leftovers.
    assert len(during) >= 0.5 * len(steps_during), "the flood starved behind the chat steps"
    # Cut to a share of a chat step (the cost model needs a few decodes to learn the costs).
    lengths = sorted(end - start for _, start, end, _ in during[4:])
    assert lengths[len(lengths) // 2] < 1.5 * TURN_SHARE * chat_step_s
    alone_batches = [e[3] for e in spans if e[0] == "embed" and e[1] > chat_end + 0.25]
    assert max(alone_batches) > 4 * max(e[3] for e in during[4:])
