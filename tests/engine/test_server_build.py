"""The composition root on a real (tiny) model: what the startup line says, and that the
model it names loads with the flags given."""

from __future__ import annotations

import asyncio

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
