"""The registry of a running server: which models it may serve, which are loaded, and when
each is loaded and let go.

Rules (each checked by tests/unit/test_registry.py):
- A model loads on its first use. Concurrent first requests wait for one load, never two; a
  load that fails fails those requests only, and the next request tries again.
- A model never unloads while it has requests in flight: a request holds a `Lease` from the
  moment its model is resolved until its answer is sent (a stream until its last event).
- When its last lease ends, a model is kept `keep_alive` seconds (the request's, else the
  server's; 0 unloads at once, a negative value keeps it for good), then unloaded by the
  reaper.
- Before a load, least recently used idle models are unloaded until `max_models` and the
  memory budget allow the new one. A model that cannot fit even then is refused (507), and
  the models already loaded keep serving.

The registry is generic over what a loaded model is (`T`): the API builds it (engine, template,
grammars), so this module knows nothing of llama.cpp or HTTP. The loader is a coroutine that
does its heavy work in a worker thread; the registry's state is only touched on the event
loop, so it needs no lock (one asyncio lock orders loads and evictions).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Generic, Protocol, TypeVar

from ferrum.errors import FerrumError, ModelLoadError, ServiceUnavailable
from ferrum.models.adapters import LoraAdapter, named_adapter
from ferrum.models.errors import InsufficientMemory, ModelBusy, ModelNotFound
from ferrum.models.presets import Preset

log = logging.getLogger("ferrum.models")

T = TypeVar("T")
_REAP_INTERVAL_S = 0.5


@dataclass(frozen=True)
class ModelSpec:
    """A model the server may serve: its name, where its file is and its settings."""

    name: str
    locate: Callable[[], str]  # the file llama.cpp loads (a split model's first shard)
    source: str = ""
    created: float = 0.0
    preset: Preset = field(default_factory=Preset)
    adapters: tuple[LoraAdapter, ...] = ()  # LoRA adapters served on it, in id order
    mmproj: str = ""  # its vision projector GGUF (`--mmproj`); "": it sees no images

    @property
    def aliases(self) -> tuple[str, ...]:
        return self.preset.aliases


class RegistryObserver(Protocol):
    def on_load(self, name: str, seconds: float) -> None: ...
    def on_unload(self, name: str, reason: str) -> None: ...
    def on_loaded_count(self, n: int) -> None: ...


@dataclass
class _Slot(Generic[T]):
    spec: ModelSpec
    model: T | None = None
    loading: asyncio.Future[T] | None = None
    in_flight: int = 0
    estimate: int = 0  # bytes, weights + KV, measured before its first load
    last_used: float = 0.0
    expires_at: float | None = None  # monotonic; None: kept until evicted
    loaded_at: float = 0.0
    deleting: bool = False


@dataclass
class Lease(Generic[T]):
    """A request's hold on a loaded model; `release` (idempotent) lets the model go idle."""

    name: str
    model: T
    _release: Callable[[], None] = field(repr=False)
    _released: bool = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


@dataclass(frozen=True)
class LoadedModel(Generic[T]):
    spec: ModelSpec
    model: T
    in_flight: int
    expires_at: float | None  # wall-clock seconds; None: never
    size: int  # the estimate its load was admitted with


class Registry(Generic[T]):
    def __init__(
        self,
        specs: Sequence[ModelSpec],
        load: Callable[[ModelSpec], Awaitable[T]],
        unload: Callable[[T], Awaitable[None]],
        *,
        estimate: Callable[[ModelSpec], int] = lambda spec: 0,
        keep_alive: float = 300.0,
        max_models: int = 0,
        memory_budget: int = 0,
        observer: RegistryObserver | None = None,
        threads: Executor | None = None,  # where `estimate` runs (None: the default pool)
    ):
        if not specs:
            raise ValueError("a registry needs at least one model")
        self._slots: dict[str, _Slot[T]] = {}
        for spec in specs:
            self.add(spec)
        self.default = specs[0].name
        self._load, self._unload, self._estimate = load, unload, estimate
        self.keep_alive = keep_alive
        self.max_models = max_models
        self.memory_budget = memory_budget
        self._observer = observer
        self._threads = threads
        self._reaper: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one load or eviction decision at a time

    # -- names ------------------------------------------------------------------------------

    def add(self, spec: ModelSpec) -> None:
        """Adds a model (a pull while serving) or replaces an idle one's spec."""
        slot = self._slots.get(spec.name)
        if slot is None:
            self._slots[spec.name] = _Slot(spec)
        elif slot.model is None and slot.loading is None:
            slot.spec = spec

    def set_adapters(self, name: str, adapters: tuple[LoraAdapter, ...]) -> None:
        """A served model's LoRA adapters after one was loaded, unloaded or rescaled: what
        requests may pick, and what its next load loads."""
        slot = self._slots[name]
        slot.spec = replace(slot.spec, adapters=adapters)

    def specs(self) -> list[ModelSpec]:
        return [s.spec for s in self._slots.values()]

    def resolve(self, name: str) -> ModelSpec:
        """The model a request names. With one model served any name (or none) answers with
        it, as llama.cpp's single-model server does; otherwise an empty name means the first
        model given and an unknown one is a 404 listing what exists."""
        if len(self._slots) == 1:
            spec = next(iter(self._slots.values())).spec
            if name and self._find(name) is None:
                named_adapter(spec, name)  # a 404 for an adapter it lacks
            return spec
        if not name:
            return self._slots[self.default].spec
        found = self._find(name) or self._find_adapter(name)
        if found is None:
            raise ModelNotFound(name, sorted(self._slots))
        return found.spec

    def lookup(self, name: str) -> ModelSpec | None:
        """The model of exactly this name or alias (no single-model fallback)."""
        slot = self._find(name)
        return None if slot is None else slot.spec

    def _find(self, name: str) -> _Slot[T] | None:
        if name in self._slots:
            return self._slots[name]
        wanted = name.lower().removesuffix(":latest")
        for slot in self._slots.values():
            names = (slot.spec.name, *slot.spec.aliases)
            if any(n.lower().removesuffix(":latest") == wanted for n in names):
                return slot
        return None

    def _find_adapter(self, name: str) -> _Slot[T] | None:
        """The base model of an adapter named `BASE:NAME` (404 for an unknown adapter of a
        base that has adapters), or named by its bare name when one model has it."""
        base, colon, _ = name.rpartition(":")
        slot = self._find(base) if colon else None
        if slot is not None:
            return slot if named_adapter(slot.spec, name) is not None else None
        owners = [s for s in self._slots.values() if named_adapter(s.spec, name) is not None]
        return owners[0] if len(owners) == 1 else None

    # -- leases -----------------------------------------------------------------------------

    async def acquire(
        self, name: str, keep_alive: float | None = None, bound: float | None = None
    ) -> Lease[T]:
        """The named model, loaded if need be, held until the lease is released.

        keep_alive: seconds to keep the model after this request (0: unload at once,
        negative: keep for good, None: the model's preset, else the server's). bound: for a
        caller who may not decide for everyone, keep_alive can only lengthen the model's own
        keep-alive, up to `bound` seconds (keep for good is taken as `bound`)."""
        slot = self._slots[self.resolve(name).name]
        if slot.deleting:
            raise ModelBusy(f"model {slot.spec.name!r} is being deleted")
        slot.in_flight += 1  # held from here: no eviction while it loads for us
        try:
            model = await self._ensure_loaded(slot)
        except BaseException:
            slot.in_flight -= 1
            raise
        preset = slot.spec.preset.keep_alive
        own = self.keep_alive if preset is None else preset
        ttl = own if keep_alive is None else keep_alive
        if bound is not None and own >= 0:
            ttl = bound if ttl < 0 else min(ttl, bound)
            ttl = max(ttl, own)
        elif bound is not None:
            ttl = own  # the model is kept for good anyway
        return Lease(slot.spec.name, model, lambda: self._release(slot, ttl))

    def _release(self, slot: _Slot[T], keep_alive: float) -> None:
        slot.in_flight -= 1
        now = time.monotonic()
        slot.last_used = now
        slot.expires_at = None if keep_alive < 0 else now + keep_alive
        if slot.in_flight == 0 and keep_alive == 0:
            self._wake_reaper()

    async def _ensure_loaded(self, slot: _Slot[T]) -> T:
        if slot.model is not None:
            return slot.model
        if slot.loading is None:
            slot.loading = asyncio.ensure_future(self._load_slot(slot))
        # shield: one waiter's cancellation (a client hanging up) must not cancel the load
        # the others wait for.
        return await asyncio.shield(slot.loading)

    async def _load_slot(self, slot: _Slot[T]) -> T:
        try:
            async with self._lock:
                await self._make_room(slot)
                started = time.perf_counter()
                model = await self._load(slot.spec)
                seconds = time.perf_counter() - started
        except FerrumError:
            raise
        except Exception as exc:  # a broken model fails its requests, never the server
            log.exception("loading %s failed", slot.spec.name)
            raise ModelLoadError(f"model {slot.spec.name!r} cannot be loaded: {exc}") from exc
        finally:
            slot.loading = None  # (no await until the model is set: nobody sees the gap)
        slot.model, slot.loaded_at = model, time.time()
        slot.last_used, slot.expires_at = time.monotonic(), None
        log.info("loaded %s in %.2f s", slot.spec.name, seconds)
        if self._observer is not None:
            self._observer.on_load(slot.spec.name, seconds)
            self._observer.on_loaded_count(self.loaded_count)
        return model

    async def _make_room(self, slot: _Slot[T]) -> None:
        if not slot.estimate:
            loop = asyncio.get_running_loop()
            slot.estimate = await loop.run_in_executor(self._threads, self._estimate, slot.spec)
        need = slot.estimate
        if self.memory_budget and need > self.memory_budget:
            raise InsufficientMemory(
                f"model {slot.spec.name!r} needs about {need / 2**20:.0f} MiB, more than the "
                f"memory budget of {self.memory_budget / 2**20:.0f} MiB"
            )
        while self._over_limits(need):
            victim = self._least_recently_used_idle()
            if victim is None:
                raise ServiceUnavailable(
                    f"cannot load {slot.spec.name!r}: the models loaded are all busy and "
                    "another would exceed --max-models or --memory-budget; retry shortly"
                )
            await self._unload_slot(victim, "evicted")

    def _over_limits(self, need: int) -> bool:
        loaded = [s for s in self._slots.values() if s.model is not None]
        if self.max_models and len(loaded) + 1 > self.max_models:
            return True
        used = sum(s.estimate for s in loaded)
        return bool(self.memory_budget) and used + need > self.memory_budget

    def _least_recently_used_idle(self) -> _Slot[T] | None:
        idle = [s for s in self._slots.values() if s.model is not None and s.in_flight == 0]
        return min(idle, key=lambda s: s.last_used, default=None)

    async def _unload_slot(self, slot: _Slot[T], reason: str) -> None:
        model, slot.model, slot.expires_at = slot.model, None, None
        if model is None:
            return
        try:
            await self._unload(model)
        except Exception:  # a failed close must not take the registry down with it
            log.exception("unloading %s failed", slot.spec.name)
        log.info("unloaded %s (%s)", slot.spec.name, reason)
        if self._observer is not None:
            self._observer.on_unload(slot.spec.name, reason)
            self._observer.on_loaded_count(self.loaded_count)

    # -- state ------------------------------------------------------------------------------

    @property
    def loaded_count(self) -> int:
        return sum(s.model is not None for s in self._slots.values())

    def loaded(self) -> list[LoadedModel[T]]:
        now_mono, now_wall = time.monotonic(), time.time()
        out = []
        for slot in self._slots.values():
            if slot.model is None:
                continue
            expires = None
            if slot.expires_at is not None and slot.in_flight == 0:
                expires = now_wall + max(0.0, slot.expires_at - now_mono)
            out.append(LoadedModel(slot.spec, slot.model, slot.in_flight, expires, slot.estimate))
        return out

    def is_loaded(self, name: str) -> bool:
        slot = self._find(name)
        return slot is not None and slot.model is not None

    async def unload(self, name: str, reason: str = "requested") -> bool:
        """Unloads a model now if nothing is in flight on it; False when it was busy."""
        slot = self._find(name)
        if slot is None:
            raise ModelNotFound(name, sorted(self._slots))
        if slot.in_flight:
            return False
        async with self._lock:
            await self._unload_slot(slot, reason)
        return True

    async def remove(self, name: str, delete: Callable[[], None]) -> None:
        """Takes a model out (`ferrum rm` / `DELETE /api/delete`): new requests for it get a
        409 while it goes, and then a 404. Refused while it has requests in flight."""
        slot = self._find(name)
        if slot is None:
            raise ModelNotFound(name, sorted(self._slots))
        if slot.in_flight:
            raise ModelBusy(f"model {slot.spec.name!r} has requests in flight")
        if len(self._slots) == 1:
            raise ModelBusy(f"model {slot.spec.name!r} is the only model served")
        slot.deleting = True
        try:
            async with self._lock:
                await self._unload_slot(slot, "deleted")
            await asyncio.to_thread(delete)
            del self._slots[slot.spec.name]
            if self.default == slot.spec.name and self._slots:
                self.default = next(iter(self._slots))
        except FerrumError:
            slot.deleting = False
            raise

    # -- the reaper -------------------------------------------------------------------------

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    def _wake_reaper(self) -> None:
        if self._reaper is not None:
            self._wake.set()

    async def _reap_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _REAP_INTERVAL_S)
            self._wake.clear()
            await self.reap()

    async def reap(self) -> None:
        """Unloads every idle model whose keep-alive has passed."""
        now = time.monotonic()
        for slot in list(self._slots.values()):
            expired = slot.expires_at is not None and slot.expires_at <= now
            if slot.model is not None and slot.in_flight == 0 and expired:
                async with self._lock:
                    if slot.in_flight == 0 and slot.loading is None:
                        await self._unload_slot(slot, "expired")

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for slot in self._slots.values():
            await self._unload_slot(slot, "shutdown")
