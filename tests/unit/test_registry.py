"""The registry's rules with a fake loader: one load for concurrent first uses, no unload
while in flight, keep-alive, least-recently-used eviction under --max-models and a budget."""

from __future__ import annotations

import asyncio

import pytest

from ferrum.errors import ModelLoadError, ServiceUnavailable
from ferrum.models.errors import InsufficientMemory, ModelBusy, ModelNotFound
from ferrum.models.presets import Preset
from ferrum.models.registry import ModelSpec, Registry


class Loads:
    """A fake loader that records what it loaded and unloaded."""

    def __init__(self, delay: float = 0.0, fail: set[str] | None = None):
        self.delay, self.fail = delay, fail or set()
        self.loaded: list[str] = []
        self.unloaded: list[str] = []
        self.live: set[str] = set()

    async def load(self, spec: ModelSpec) -> str:
        await asyncio.sleep(self.delay)
        if spec.name in self.fail:
            raise OSError(f"cannot load {spec.name}")
        self.loaded.append(spec.name)
        self.live.add(spec.name)
        return f"model:{spec.name}"

    async def unload(self, model: str) -> None:
        name = model.removeprefix("model:")
        self.unloaded.append(name)
        self.live.discard(name)


def _specs(*names: str, **presets: Preset) -> list[ModelSpec]:
    return [ModelSpec(n, lambda: "", preset=presets.get(n, Preset())) for n in names]


def _registry(loads: Loads, *names: str, sizes: dict[str, int] | None = None, **kw):
    sizes = sizes or {}
    return Registry(
        _specs(*names), loads.load, loads.unload, estimate=lambda s: sizes.get(s.name, 1), **kw
    )


def run(coro):
    return asyncio.run(coro)


def test_concurrent_first_requests_wait_for_one_load():
    async def main():
        loads = Loads(delay=0.05)
        reg = _registry(loads, "a", "b")
        leases = await asyncio.gather(*(reg.acquire("a") for _ in range(8)))
        assert loads.loaded == ["a"] and {lease.model for lease in leases} == {"model:a"}
        for lease in leases:
            lease.release()

    run(main())


def test_a_failed_load_fails_its_requests_and_the_next_one_tries_again():
    async def main():
        loads = Loads(fail={"a"})
        reg = _registry(loads, "a", "b")
        with pytest.raises(ModelLoadError):
            await reg.acquire("a")
        loads.fail.clear()
        lease = await reg.acquire("a")
        assert lease.model == "model:a" and reg.loaded()[0].in_flight == 1
        lease.release()
        assert reg.loaded()[0].in_flight == 0

    run(main())


def test_names_resolve_exactly_then_loosely_and_unknown_ones_list_what_exists():
    reg = Registry(
        _specs("org/repo:Q4_K_M", "smol", smol=Preset(aliases=("gpt-4o",))),
        Loads().load,
        Loads().unload,
    )
    assert reg.resolve("org/repo:q4_k_m").name == "org/repo:Q4_K_M"
    assert reg.resolve("smol:latest").name == "smol"
    assert reg.resolve("GPT-4o").name == "smol"
    assert reg.resolve("").name == "org/repo:Q4_K_M"  # the first given is the default
    with pytest.raises(ModelNotFound) as err:
        reg.resolve("nope")
    assert err.value.status == 404 and "'smol'" in err.value.message


def test_one_model_answers_to_any_name():
    reg = Registry(_specs("only"), Loads().load, Loads().unload)
    assert reg.resolve("gpt-4o").name == "only"


def test_keep_alive_zero_unloads_after_the_last_request_only():
    async def main():
        loads = Loads()
        reg = _registry(loads, "a", "b")
        first = await reg.acquire("a", keep_alive=0)
        second = await reg.acquire("a", keep_alive=0)
        first.release()
        await reg.reap()
        assert loads.live == {"a"}, "unloaded while a request was in flight"
        second.release()
        await reg.reap()
        assert loads.live == set() and loads.unloaded == ["a"]

    run(main())


def test_keep_alive_expires_and_negative_keeps_for_good():
    async def main():
        loads = Loads()
        reg = _registry(loads, "a", "b", keep_alive=0.05)
        (await reg.acquire("a")).release()
        (await reg.acquire("b", keep_alive=-1)).release()
        assert [m.expires_at is None for m in reg.loaded()] == [False, True]
        await asyncio.sleep(0.08)
        await reg.reap()
        assert loads.live == {"b"}

    run(main())


def test_the_reaper_runs_by_itself():
    async def main():
        loads = Loads()
        reg = _registry(loads, "a", "b")
        reg.start()
        (await reg.acquire("a", keep_alive=0)).release()
        for _ in range(50):
            if not loads.live:
                break
            await asyncio.sleep(0.02)
        await reg.close()
        assert loads.unloaded == ["a"]

    run(main())


def test_max_models_evicts_the_least_recently_used_idle_model():
    async def main():
        loads = Loads()
        reg = _registry(loads, "a", "b", "c", max_models=2, keep_alive=-1)
        (await reg.acquire("a")).release()
        held = await reg.acquire("b")
        (await reg.acquire("a")).release()  # a is now more recent than b, but b is busy
        (await reg.acquire("c")).release()
        assert loads.live == {"b", "c"} and loads.unloaded == ["a"]
        held.release()

    run(main())


def test_all_busy_at_the_limit_is_a_503_and_nothing_is_unloaded():
    async def main():
        loads = Loads()
        reg = _registry(loads, "a", "b", max_models=1)
        held = await reg.acquire("a")
        with pytest.raises(ServiceUnavailable):
            await reg.acquire("b")
        assert loads.live == {"a"} and reg.loaded()[0].in_flight == 1
        held.release()
        (await reg.acquire("b")).release()
        assert loads.live == {"b"}

    run(main())


def test_memory_budget_evicts_to_fit_and_refuses_a_model_that_never_fits():
    async def main():
        loads = Loads()
        sizes = {"a": 60, "b": 50, "huge": 200}
        reg = _registry(loads, "a", "b", "huge", sizes=sizes, memory_budget=100)
        (await reg.acquire("a")).release()
        (await reg.acquire("b")).release()
        assert loads.live == {"b"}
        with pytest.raises(InsufficientMemory) as err:
            await reg.acquire("huge")
        assert err.value.status == 507 and loads.live == {"b"}

    run(main())


def test_remove_refuses_while_in_flight_and_then_takes_the_name_away():
    async def main():
        loads = Loads()
        reg = _registry(loads, "a", "b", "c")
        held = await reg.acquire("a")
        deleted = []
        with pytest.raises(ModelBusy):
            await reg.remove("a", lambda: deleted.append("a"))
        held.release()
        await reg.remove("a", lambda: deleted.append("a"))
        assert deleted == ["a"] and loads.live == set()
        with pytest.raises(ModelNotFound):
            reg.resolve("a")
        assert reg.default == "b"  # the default moves on to the next model given

    run(main())


def test_a_cancelled_waiter_does_not_cancel_the_load_others_wait_for():
    async def main():
        loads = Loads(delay=0.05)
        reg = _registry(loads, "a", "b")
        first = asyncio.ensure_future(reg.acquire("a"))
        second = asyncio.ensure_future(reg.acquire("a"))
        await asyncio.sleep(0.01)
        first.cancel()
        lease = await second
        assert lease.model == "model:a" and reg.loaded()[0].in_flight == 1
        lease.release()

    run(main())


def test_lease_release_is_idempotent():
    async def main():
        reg = _registry(Loads(), "a", "b")
        lease = await reg.acquire("a")
        lease.release()
        lease.release()
        assert reg.loaded()[0].in_flight == 0

    run(main())


def test_a_loader_that_breaks_is_a_503_naming_the_model():
    async def main():
        async def broken(spec):
            raise FileExistsError("the assembled file differs")

        reg = Registry(_specs("a", "b"), broken, Loads().unload)
        with pytest.raises(ModelLoadError) as err:
            await reg.acquire("a")
        assert err.value.status == 503 and "'a'" in err.value.message
        assert reg.loaded() == []

    run(main())
