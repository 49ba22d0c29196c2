"""The composition root: builds runner, engine, metrics and app from the configs."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from ferrum.api.app import ServerState, create_app
from ferrum.api.chat_template import ChatFormatter, resolve_template
from ferrum.config import EngineConfig, ServerConfig
from ferrum.engine.async_engine import AsyncEngine
from ferrum.engine.engine import LLMEngine
from ferrum.engine.runner import LlamaRunner
from ferrum.metrics import Metrics


def build_server(
    engine_cfg: EngineConfig, server_cfg: ServerConfig, model_path: str
) -> tuple[FastAPI, str]:
    """The app (not yet started) and a one-line description for the startup log."""
    runner = LlamaRunner(engine_cfg, model_path)
    info = runner.info
    try:
        template = resolve_template(server_cfg.chat_template, info.chat_template, info.architecture)
        formatter = ChatFormatter(template, info.bos_text, info.eos_text, info.add_bos)
    except Exception:
        runner.close()
        raise
    metrics = Metrics()
    engine = LLMEngine(
        runner,
        block_size=engine_cfg.block_size,
        observer=metrics,
        max_running=engine_cfg.parallel,
        prefix_cache=not engine_cfg.no_prefix_cache,
    )
    alias = server_cfg.alias or Path(model_path).stem
    state = ServerState(
        engine=AsyncEngine(engine, max_queue=server_cfg.max_queue),
        vocab=runner.vocab,
        info=info,
        formatter=formatter,
        metrics=metrics,
        alias=alias,
        api_keys=server_cfg.api_key,
        public_metrics=server_cfg.public_metrics,
        request_timeout=server_cfg.request_timeout,
        split_think=not server_cfg.reasoning_inline,
        default_max_tokens=engine_cfg.n_predict,
    )
    kind = "hybrid" if info.is_hybrid else "recurrent" if info.is_recurrent else "attention"
    summary = (
        f"ferrum serving {alias} ({info.architecture}, {info.description}, {kind}) "
        f"ctx={info.n_ctx} parallel={engine_cfg.parallel} batch={info.n_batch} "
        f"threads={info.threads} on http://{server_cfg.host}:{server_cfg.port}"
    )
    return create_app(state), summary
