"""The composition root on a real (tiny) model: what the startup line says, and that the
model it names loads with the flags given."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
from ferrum.server import build_server


def test_startup_line_states_the_flags_as_given(tiny_llama, tmp_path):
    # The context holds twice --parallel sequence ids (the rest keep parked sequences), and
    # the line once printed that number as "parallel".
    engine_cfg = EngineConfig(
        ctx_size=512, parallel=3, batch_size=64, threads=2, cache_dir=str(tmp_path / "kv")
    )
    models = ModelsConfig(model=(f"tiny={tiny_llama}",), models_dir=str(tmp_path))
    app, summary = build_server(engine_cfg, ServerConfig(port=9999), models)
    assert "parallel=3 " in summary and "ctx=512 " in summary and "tiny" in summary
    registry = app.state.ferrum.models

    async def load_and_close() -> None:
        lease = await registry.acquire("tiny")
        info = lease.model.info
        assert (info.n_ctx, info.n_batch) == (512, 64)
        lease.release()
        await registry.close()

    asyncio.run(load_and_close())


def test_a_model_loads_while_the_default_thread_pool_is_taken(tiny_llama, tmp_path):
    """Six hung-up pulls once held the default pool for minutes, and every model load waited
    behind them: loads and unloads have threads of their own."""
    engine_cfg = EngineConfig(ctx_size=512, parallel=2, batch_size=64, threads=2)
    models = ModelsConfig(model=(f"tiny={tiny_llama}",), models_dir=str(tmp_path))
    registry = build_server(engine_cfg, ServerConfig(port=9999), models)[0].state.ferrum.models

    async def load_beside_a_full_pool() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        release = threading.Event()
        busy = asyncio.ensure_future(asyncio.to_thread(release.wait))  # the pool's one thread
        try:
            lease = await asyncio.wait_for(registry.acquire("tiny"), 20)
            lease.release()
        finally:
            release.set()
            await busy
            await registry.close()

    asyncio.run(load_beside_a_full_pool())
