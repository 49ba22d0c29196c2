"""Builders for the engine's contracts, and a fake runner with a byte tokenizer.

The fake runner behaves like llama.cpp where it matters to the engine and is stricter where
llama.cpp would silently corrupt: it keeps each sequence's tokens by position, refuses a chunk
whose first position is not the sequence's next one ("non-consecutive positions"), refuses
batches over n_batch, and raises if a sequence id is used by a new request before it was
cleared. Its "model" picks the next token from everything resident in the sequence, so stale
or missing KV shows up as different output.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import llguidance

from ferrum.engine.constraint import Constraint, Constraints, allowed_together
from ferrum.engine.contracts import BatchItem, ModelInfo, StepResult, TokenLogprobs
from ferrum.engine.engine import LLMEngine
from ferrum.engine.request import SamplingParams

BOS = 256
EOS = 257
N_VOCAB = 258


def byte_tokenize(text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
    return ([BOS] if add_special else []) + list(text.encode("utf-8"))


def model_info(**overrides: object) -> ModelInfo:
    base = ModelInfo(
        path="fake.gguf",
        architecture="fake",
        description="fake byte model",
        n_ctx=1024,
        n_ctx_train=1024,
        n_batch=64,
        n_seq_max=8,
        n_vocab=N_VOCAB,
        n_swa=0,
        threads=1,
        is_recurrent=False,
        is_hybrid=False,
        chat_template=None,
        bos_text="",
        eos_text="",
        add_bos=True,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def sampling(**overrides: object) -> SamplingParams:
    return replace(SamplingParams(max_tokens=8, temperature=0.0), **overrides)  # type: ignore[arg-type]


def default_next_token(history: Sequence[int]) -> int:
    """Lower-case letters that depend on the whole resident history."""
    h = 7
    for t in history:
        h = (h * 31 + t) % 1_000_003
    return ord("a") + h % 26


@dataclass
class FakeSampler:
    params: SamplingParams
    closed: bool = False
    constraint: Constraint | None = None


class _ByteTokenizer:
    """What llguidance's TokenizerWrapper reads: the fake's 258 tokens."""

    eos_token_id = EOS
    bos_token_id = BOS
    tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"]
    special_token_ids = [BOS, EOS]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def _byte_constraints() -> Constraints:
    wrapper = llguidance.TokenizerWrapper(_ByteTokenizer())
    return Constraints(llguidance.LLTokenizer(wrapper, slices=[]), [EOS])


_BYTE_CONSTRAINTS: list[Constraints] = []  # built once: every fake vocabulary shares it


class FakeVocab:
    """Bytes are tokens 0-255; BOS and EOS above them. Grammars are real llguidance ones over
    these tokens (the fake runner enforces them)."""

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return byte_tokenize(text, add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else b""

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def max_token_bytes(self) -> int:
        return 1  # a byte a token; BOS and EOS are never parsed from text

    def constraints(self) -> Constraints:
        if not _BYTE_CONSTRAINTS:
            _BYTE_CONSTRAINTS.append(_byte_constraints())
        return _BYTE_CONSTRAINTS[0]

    def check_grammar(self, grammar: str) -> None:
        self.constraints().check(grammar)


@dataclass
class FakeAdapters:
    """The fake's LoRA files: loaded by path (a file that does not start with LORA_MAGIC is
    refused, as llama.cpp refuses another base's adapter), freed by id."""

    paths: list[str | None] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)

    def load(self, path: str) -> int:
        from ferrum.errors import ModelLoadError

        with open(path, "rb") as f:
            if f.read(len(LORA_MAGIC)) != LORA_MAGIC:
                raise ModelLoadError(f"llama.cpp refused the LoRA adapter {path}")
        self.paths.append(path)
        return len(self.paths) - 1

    def unload(self, adapter_id: int) -> None:
        self.paths[adapter_id] = None
        self.freed.append(adapter_id)


LORA_MAGIC = b"fake lora for the fake base"


@dataclass
class FakeRunner:
    info: ModelInfo = field(default_factory=model_info)
    next_token: Callable[[Sequence[int]], int] = default_next_token
    kv: dict[int, list[int]] = field(default_factory=dict)
    # Fault injection: sequence ids whose next decode fails (once each).
    fail_seqs: set[int] = field(default_factory=set)
    samplers: dict[str, FakeSampler] = field(default_factory=dict)  # live, by request id
    closed_samplers: list[FakeSampler] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    adapter_sets: list[tuple] = field(default_factory=list)  # each decode's LoRA set
    cleared: list[int] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    step_delay_s: float = 0.0  # a slow model, for deadlines and disconnects
    # (fixed, per token) seconds each decode reports having taken (None: not measured)
    decode_cost: tuple[float, float] | None = None
    # Sequences whose sliding window has lost cells: `holds_window` refuses copies from them.
    lost_windows: set[int] = field(default_factory=set)
    vocab: FakeVocab = field(default_factory=FakeVocab)
    refuse_restores: bool = False  # llama.cpp refusing every saved state
    restores: list[tuple[int, int]] = field(default_factory=list)  # (seq, positions)
    adapters: FakeAdapters = field(default_factory=FakeAdapters)

    def start_request(self, request_id: str, params: SamplingParams) -> None:
        if request_id in self.samplers:
            raise AssertionError(f"a second sampler for {request_id}")
        constraint = None
        if params.grammar is not None:
            constraint = self.vocab.constraints().constraint(params.grammar)
        self.samplers[request_id] = FakeSampler(params, constraint=constraint)

    def finish_request(self, request_id: str) -> None:
        sampler = self.samplers.pop(request_id, None)
        if sampler is not None:
            sampler.closed = True
            self.closed_samplers.append(sampler)

    def clear_sequence(self, seq_id: int) -> None:
        self.kv.pop(seq_id, None)
        self.lost_windows.discard(seq_id)
        self.cleared.append(seq_id)

    def copy_sequence(self, src: int, dst: int, length: int) -> None:
        if self.kv.get(dst):
            raise AssertionError(f"copy into seq {dst}, which still holds cells")
        if len(self.kv.get(src, [])) < length:
            raise AssertionError(f"copy of {length} positions from seq {src}, which has fewer")
        self.kv[dst] = self.kv[src][:length]
        self.copies.append((src, dst, length))

    def checkpoint(self, src: int, length: int) -> bytearray | None:
        if src in self.lost_windows or len(self.kv.get(src, [])) < length:
            return None
        return bytearray(b"FAKE" + array("i", self.kv[src][:length]).tobytes())

    def copy_own(self, src: int, dst: int, length: int) -> bytearray | None:
        state = self.checkpoint(src, length)
        if state is None or not self.restore_sequence(dst, state):
            return None
        self.copies.append((src, dst, length))
        return state

    def holds_window(self, seq_id: int, length: int) -> bool:
        return seq_id not in self.lost_windows

    def save_sequence(self, seq_id: int) -> bytearray | None:
        cells = self.kv.get(seq_id)
        return bytearray(b"FAKE" + array("i", cells).tobytes()) if cells else None

    def restore_sequence(self, seq_id: int, state: bytearray) -> bool:
        if self.kv.get(seq_id):
            raise AssertionError(f"restore into seq {seq_id}, which still holds cells")
        if self.refuse_restores or not state.startswith(b"FAKE"):
            return False
        cells = array("i")
        cells.frombytes(bytes(state[4:]))
        self.kv[seq_id] = cells.tolist()
        self.restores.append((seq_id, len(cells)))
        return True

    def execute(self, items: Sequence[BatchItem]) -> StepResult:
        n = sum(len(i.tokens) for i in items)
        if n > self.info.n_batch:
            raise AssertionError(f"batch of {n} tokens over n_batch {self.info.n_batch}")
        if len({i.seq_id for i in items}) != len(items):
            raise AssertionError("a sequence appears twice in one batch")
        self.batch_sizes.append(n)
        sets = {i.adapters for i in items}
        if len(sets) > 1:
            raise AssertionError(f"one decode mixes adapter sets {sets}")
        if any(i in self.adapters.freed for s in sets for i, _ in s):
            raise AssertionError(f"a decode with a freed adapter: {sets}")
        self.adapter_sets.extend(sets)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        result = StepResult(decode_calls=1)
        if self.decode_cost is not None:
            result.decode_s = self.decode_cost[0] + self.decode_cost[1] * n
        rows: list[_FakeRow] = []
        for idx, item in enumerate(items):
            if item.seq_id in self.fail_seqs:
                self.fail_seqs.discard(item.seq_id)
                result.failed[idx] = "injected fault"
                continue
            _tokens_or_rows(item)
            cells = self.kv.setdefault(item.seq_id, [])
            if item.start_pos != len(cells):
                raise AssertionError(
                    f"seq {item.seq_id}: chunk at {item.start_pos}, {len(cells)} resident"
                )
            cells.extend(item.tokens)
            if item.sample_for is not None:
                sampler = self.samplers.get(item.sample_for)
                if sampler is None:
                    raise AssertionError(f"sampling for {item.sample_for}, which has no sampler")
                rows.append(_FakeRow(idx, item, cells, sampler))
        self._verify(rows, result)
        return result

    def _verify(self, rows: list[_FakeRow], result: StepResult) -> None:
        """As the llama runner (`engine/llama/step_sampling.py`): a round per position, each
        row's token at its last real position, then at each guess while the pick equals it;
        the masks of a round's refusals filled together (`allowed_together`); the cells of
        guesses not taken are removed."""
        live, j = rows, 0
        while live:
            picks = [self.next_token(row.cells[: row.real + j]) for row in live]
            refused = [
                k
                for k, row in enumerate(live)
                if row.constraint is not None and not row.constraint.allows(picks[k])
            ]
            # From two rows on the pool (the engine waits for more): random traffic reaches it.
            masks = allowed_together([live[k].constraint for k in refused], N_VOCAB, 2)
            for k, allowed in zip(refused, masks, strict=True):
                picks[k] = _choice(allowed, live[k].cells[: live[k].real + j])
            going = []
            for row, token in zip(live, picks, strict=True):
                if row.constraint is not None and token != EOS:
                    row.constraint.accept(token)
                row.take(token)
                if j < row.item.draft and token == row.guesses[j]:
                    going.append(row)
            live, j = going, j + 1
        for row in rows:
            result.sampled[row.idx] = row.tokens
            if row.constraint is not None:  # as the llama runner reports its masks
                taken, row.constraint.mask_seconds = row.constraint.mask_seconds, []
                result.mask_seconds += taken
            if row.logprobs:
                result.logprobs[row.idx] = row.logprobs
            del row.cells[row.real + len(row.tokens) - 1 :]

    def close(self) -> None:
        """As llama.cpp's context is freed on unload: a model loaded again (the same fake
        runner, a new engine) must not find the old engine's sequences still resident."""
        self.kv.clear()
        self.lost_windows.clear()
        for request_id in list(self.samplers):
            self.finish_request(request_id)

    def trim_sequence(self, seq_id: int, length: int) -> None:
        cells = self.kv.get(seq_id, [])
        if len(cells) < length:
            raise AssertionError(f"trim of seq {seq_id} to {length}: only {len(cells)} held")
        del cells[length:]


def _tokens_or_rows(item: BatchItem) -> None:
    """As llama_decode: every position is a vocabulary token (≥ 0) or an image row; an
    image's ids (< 0, `image_token_ids`) stand only where its rows are decoded. The fake
    model then reads the ids as the image (they are drawn from its pixels)."""
    rows = {i for offset, r in item.embeds for i in range(offset, offset + len(r))}
    for i, token in enumerate(item.tokens):
        if (token < 0) != (i in rows):
            raise AssertionError(f"seq {item.seq_id}: position {item.start_pos + i} holds "
                                 f"{token}, {'an' if i in rows else 'no'} image row")  # fmt: skip


def count_copies(runner: object, seen: Callable[[int], None]) -> None:
    """Calls `seen(length)` on each of runner's prefix copies into cells of its own."""
    copy_own = runner.copy_own  # type: ignore[attr-defined]

    def counted(src: int, dst: int, length: int) -> bytearray | None:
        seen(length)
        return copy_own(src, dst, length)

    runner.copy_own = counted  # type: ignore[attr-defined]


def fake_engine(
    runner: FakeRunner | None = None, block_size: int = 16, prefix_cache: bool = True
) -> LLMEngine:
    """Half the model's sequence ids run requests, the other half hold parked sequences."""
    runner = runner or FakeRunner()
    return LLMEngine(
        runner,
        block_size=block_size,
        max_running=max(1, runner.info.n_seq_max // 2),
        prefix_cache=prefix_cache,
    )


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, dict]:
    """Steps until idle; returns per request the joined content and the final output."""
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return results
        for out in engine.step():
            r = results.setdefault(
                out.request_id,
                {"content": "", "reasoning": "", "tokens": [], "logprobs": [], "final": None},
            )
            r["content"] += out.content
            r["reasoning"] += out.reasoning
            r["tokens"] += out.token_ids
            r["logprobs"] += out.logprobs or []
            if out.finished:
                r["final"] = out
        engine.check_integrity()
    raise AssertionError("engine did not drain")


@contextmanager
def llama_engine(
    path: str,
    prefix_cache: bool = True,
    ctx: int = 2048,
    parallel: int = 4,
    batch: int = 64,
    speculation=None,
    lora: Sequence[str] = (),
    mmproj: str = "",
    swa_windows: bool = False,
    kv_streams: bool = False,
) -> Iterator[LLMEngine]:
    """An engine on a real (tiny) GGUF with llama.cpp (and these LoRA adapters, ids in
    order; this vision projector; `swa_windows`: a window cache sized to the windows;
    `kv_streams`: a cell stream per sequence), closed afterwards."""
    from ferrum.config import EngineConfig
    from ferrum.engine.llama.runner import LlamaRunner

    cfg = EngineConfig(
        ctx_size=ctx,
        parallel=parallel,
        batch_size=batch,
        threads=2,
        no_prefix_cache=not prefix_cache,
        swa_windows=swa_windows,
        kv_streams=kv_streams,
    )
    runner = LlamaRunner(cfg, path, lora, mmproj=mmproj)
    try:
        yield LLMEngine(runner, block_size=16, max_running=parallel, prefix_cache=prefix_cache,
                        speculation=speculation)  # fmt: skip
    finally:
        runner.close()


def fake_served(name: str, runner: FakeRunner, metrics, max_queue: int = 64, **fields):
    """One fake model as the API serves it (ChatML template, byte tokenizer)."""
    from ferrum.api.loaded import ServedModel
    from ferrum.api.prompting.chat_template import BUILTIN_TEMPLATES, ChatFormatter
    from ferrum.engine.async_engine import AsyncEngine

    engine = LLMEngine(runner, block_size=16, observer=metrics, max_running=4)
    return ServedModel(
        name=name,
        engine=AsyncEngine(engine, max_queue=max_queue),
        vocab=runner.vocab,
        info=runner.info,
        formatter=ChatFormatter(BUILTIN_TEMPLATES["chatml"], "", "", True),
        metrics=metrics,
        **fields,
    )


@dataclass(frozen=True)
class FakeEmbeddingFacts:
    n_embd: int = 16
    max_tokens: int = 32
    pooling: str = "mean"
    n_vocab: int = N_VOCAB
    architecture: str = "fake-bert"
    description: str = "fake embedding model"


class FakeEmbedder:
    """Embeds token lists as normalised-later histograms of their bytes folded into n_embd
    buckets: texts sharing letters come out close. Records every batch it was given."""

    def __init__(self, facts: FakeEmbeddingFacts | None = None):
        self.info = facts or FakeEmbeddingFacts()
        self.batches: list[list[list[int]]] = []
        self.alive = False

    def start(self) -> None:
        self.alive = True

    async def stop(self) -> None:
        self.alive = False

    async def embed(self, inputs):
        import numpy as np

        self.batches.append(inputs)
        out = []
        for tokens in inputs:
            v = np.zeros(self.info.n_embd, dtype=np.float32)
            for t in tokens:
                v[t % self.info.n_embd] += 1.0
            out.append(v * 3.0)  # not normalised: the API must normalise
        return out


def fake_registry(runners: dict, metrics, *, max_queue: int = 64, specs=None, **registry_kw):
    """A registry over fake models: `runners` maps each name to a factory of a FakeRunner
    (a chat model) or of a FakeEmbedder (an embedding model)."""
    from ferrum.api.loaded import EmbeddingModel
    from ferrum.models.registry import ModelSpec, Registry

    async def load(spec):
        made = runners[spec.name]()
        if isinstance(made, FakeRunner):  # ids as the real runner numbers them
            made.adapters.paths = [None if a.removed else a.path for a in spec.adapters]
        if isinstance(made, FakeEmbedder):
            made.start()
            return EmbeddingModel(spec.name, made, FakeVocab(), metrics.for_model(spec.name))
        served = fake_served(
            spec.name,
            made,
            metrics.for_model(spec.name),
            max_queue,
            sampling=dict(spec.preset.sampling),
            system=spec.preset.system,
            adapters=spec.adapters,
        )
        served.engine.start()
        return served

    async def unload(served):
        if hasattr(served, "engine"):
            await served.engine.stop()
            served.engine.core.runner.close()  # a reload starts on an empty context
        if served.embedder is not None:
            await served.embedder.stop()

    specs = specs or [ModelSpec(n, lambda: "") for n in runners]
    return Registry(specs, load, unload, observer=metrics, **registry_kw)


def fake_app(runner: FakeRunner | None = None, *, models: dict | None = None, **state: object):
    """The real FastAPI app over fake models: one named "fake" (the given runner) unless
    `models` maps names to FakeRunner factories."""
    from ferrum.api.app import create_app
    from ferrum.api.serving import ServerState
    from ferrum.server_metrics import ServerMetrics

    the_runner = runner or FakeRunner()
    metrics = ServerMetrics()
    registry_kw = state.pop("registry", {})
    registry = fake_registry(
        models or {"fake": lambda: the_runner},
        metrics,
        max_queue=int(state.pop("max_queue", 64)),  # type: ignore[call-overload]
        **registry_kw,  # type: ignore[arg-type]
    )
    return create_app(ServerState(models=registry, metrics=metrics, **state))  # type: ignore[arg-type]


# What the fake picks when its grammar refuses the model's token: the shortest way out first
# (end, closing quote and brackets, a digit), else an allowed token chosen by the history.
_PREFERRED = [EOS, *b'"}],1']


def _constrained(constraint: Constraint, token: int, history: Sequence[int]) -> int:
    """The fake's constrained pick with its mask computed alone (the oracle's way)."""
    if not constraint.allows(token):
        token = _choice(constraint.allowed(N_VOCAB), history)
    if token != EOS:
        constraint.accept(token)
    return token


def _choice(allowed: Sequence[bool], history: Sequence[int]) -> int:
    """What the fake picks among the allowed tokens when its grammar refused the model's."""
    ids = [t for t in _PREFERRED if allowed[t]] or [i for i, ok in enumerate(allowed) if ok]
    if not ids:
        return EOS
    return ids[0] if ids[0] in _PREFERRED else ids[len(history) % len(ids)]


@dataclass(eq=False)
class _FakeRow:
    """One item the fake runner samples for (`FakeRunner._verify`)."""

    idx: int
    item: BatchItem
    cells: list[int]
    sampler: FakeSampler
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.real = len(self.cells) - self.item.draft
        self.guesses = self.item.tokens[len(self.item.tokens) - self.item.draft :]
        self.constraint = self.sampler.constraint

    def take(self, token: int) -> None:
        self.tokens.append(token)
        k = self.sampler.params.logprobs
        if k is not None:
            # A made-up distribution: the sampled token first, then the next ids.
            top = tuple(((token + i) % N_VOCAB, -0.5 - i) for i in range(k))
            self.logprobs.append(TokenLogprobs(token, -0.5, top))
