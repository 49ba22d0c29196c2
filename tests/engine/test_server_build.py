"""The composition root on a real (tiny) model: what the startup line says."""

from __future__ import annotations

from ferrum.config import EngineConfig, ServerConfig
from ferrum.server import build_server


def test_startup_line_states_the_flags_as_given(tiny_llama):
    # The context holds twice --parallel sequence ids (the rest keep parked sequences), and
    # the line once printed that number as "parallel".
    engine_cfg = EngineConfig(ctx_size=512, parallel=3, batch_size=64, threads=2)
    app, summary = build_server(engine_cfg, ServerConfig(port=9999), tiny_llama)
    try:
        assert "parallel=3 " in summary and "ctx=512 " in summary and "batch=64 " in summary
    finally:
        app.state.ferrum.engine.core.runner.close()
