"""The composition root: builds the registry of models, their engines, metrics and the app
from the configs. Only here do llama.cpp's runner and the API meet."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import FastAPI

from ferrum.api.app import ServerState, create_app
from ferrum.api.auth import Keys
from ferrum.api.loaded import EmbeddingModel, Loaded, ServedModel
from ferrum.api.prompting.chat_template import ChatFormatter, resolve_template
from ferrum.api.prompting.encoded_images import EncodedImages
from ferrum.api.prompting.preparation import Preparer
from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
from ferrum.engine.async_engine import AsyncEngine
from ferrum.engine.embedding import EmbeddingEngine
from ferrum.engine.engine import LLMEngine
from ferrum.engine.kv.tiers import TierConfig
from ferrum.engine.llama.embedding_runner import EmbeddingRunner
from ferrum.engine.llama.runner import LlamaRunner
from ferrum.engine.speculation.speculator import SpecConfig
from ferrum.engine.turns import Party, Turns
from ferrum.errors import ModelLoadError
from ferrum.kv_types import check_head_sizes, check_kv_settings
from ferrum.models.adapters import attach as attach_adapters
from ferrum.models.adapters import with_digests
from ferrum.models.catalog import serve_specs
from ferrum.models.errors import InvalidModelFile
from ferrum.models.gguf_file import read_gguf
from ferrum.models.memory import estimate_bytes, facts_kv_bytes, memory_budget
from ferrum.models.presets import load_presets
from ferrum.models.projectors import attach as attach_projectors
from ferrum.models.registry import ModelSpec, Registry
from ferrum.models.store import ModelStore, default_models_dir
from ferrum.models.store_adapters import attach_stored
from ferrum.models.units import parse_duration, parse_size
from ferrum.server_metrics import ServerMetrics

log = logging.getLogger("ferrum")
T = TypeVar("T")


class _Loader:
    """Builds a served model from its spec (runner, engine, template) and tears it down.

    Loads and unloads (reading weights, freeing contexts: seconds each) run on `threads`, a
    pool of their own: on the default pool, which requests use for their short thread work,
    a few long jobs there (pulls once took all of it) made every model load wait, and a
    burst of loads would make /tokenize and embeddings wait in turn."""

    def __init__(
        self,
        engine_cfg: EngineConfig,
        server_cfg: ServerConfig,
        metrics: ServerMetrics,
        threads: ThreadPoolExecutor,
    ):
        self.engine_cfg, self.server_cfg, self.metrics = engine_cfg, server_cfg, metrics
        self.threads = threads
        # One set of turns for every engine this server runs (None: they decode side by side).
        self.turns = Turns() if engine_cfg.engine_turns == "shared" else None
        self.preparer = Preparer(self.turns)  # every chat model's requests

    def _party(self, name: str, engine: str) -> Party:
        """The engine's seat at the server's turns (without them: a seat of its own, never
        contended), shown in the model's metrics as its `engine`'s turns."""
        party = (self.turns or Turns()).join(f"{name} {engine}")
        self.metrics.for_model(name).watch_turns(engine, party)
        return party

    def engine_config(self, spec: ModelSpec) -> EngineConfig:
        """The flags' engine settings with the model's preset over them."""
        preset: dict[str, Any] = dict(spec.preset.engine)  # typed and checked by presets.py
        return dataclasses.replace(self.engine_cfg, **preset)

    async def load(self, spec: ModelSpec) -> Loaded:
        model = await self._in_thread(self._build, spec)
        # Measured once now, not by the first request that needs it (a scan of the vocabulary).
        await self._in_thread(model.vocab.max_token_bytes)
        if isinstance(model, ServedModel):
            model.engine.start()
        if model.embedder is not None:
            model.embedder.start()
        return model

    def _build(self, spec: ModelSpec) -> Loaded:
        cfg = self.engine_config(spec)
        path = spec.locate()
        try:
            facts = read_gguf(path)  # a clear reason for a cut or foreign file, first
        except InvalidModelFile as exc:
            raise ModelLoadError(f"model {spec.name!r} cannot be loaded: {exc.message}") from exc
        if facts.is_embedding_model:
            runner = self._embedding_runner(path, cfg, pooling="")
            return EmbeddingModel(
                name=spec.name,
                embedder=self._embedder(runner, spec.name),
                vocab=runner.vocab,
                metrics=self.metrics.for_model(spec.name),
                close_runner=runner.close,
            )
        try:
            check_head_sizes(cfg.cache_type_k, cfg.cache_type_v, facts.head_k, facts.head_v)
        except ValueError as exc:
            raise ModelLoadError(f"model {spec.name!r}: {exc}") from exc
        kv_cell = facts_kv_bytes(facts, cfg.cache_type_k, cfg.cache_type_v)
        return self._chat(spec, cfg, path, kv_cell)

    def _embedding_runner(self, path: str, cfg: EngineConfig, pooling: str) -> EmbeddingRunner:
        threads = cfg.resolved_threads()
        return EmbeddingRunner(
            path,
            threads=threads,
            batch_tokens=cfg.batch_size,
            pooling=pooling,
            gpu_layers=cfg.gpu_layers,
        )

    def _embedder(self, runner: EmbeddingRunner, name: str) -> EmbeddingEngine:
        return EmbeddingEngine(
            runner,
            max_queue_inputs=self.server_cfg.max_queue * 64,
            on_batch=self.metrics.for_model(name).on_embedding_batch,
            turns=self._party(name, "embeddings"),
        )

    def _chat(self, spec: ModelSpec, cfg: EngineConfig, path: str, kv_cell: int) -> ServedModel:
        # Hashed as llama.cpp loads them: a file replaced since the last load is another
        # adapter, whose requests must not reuse the old one's KV (the disk tier keeps it).
        adapters = with_digests(spec.adapters)
        lora = ["" if a.removed else a.path for a in adapters]  # ids never move
        runner = LlamaRunner(cfg, path, lora, kv_bytes_per_cell=kv_cell, mmproj=spec.mmproj)
        info = runner.info
        try:
            template = spec.preset.chat_template or self.server_cfg.chat_template
            template = resolve_template(template, info.chat_template, info.architecture)
            formatter = ChatFormatter(template, info.bos_text, info.eos_text, info.add_bos)
        except Exception:
            runner.close()
            raise
        metrics = self.metrics.for_model(spec.name)
        metrics.set_kv_types(info.cache_type_k, info.cache_type_v, info.flash_attn)
        engine = _engine(runner, cfg, path, metrics)
        sampling = dict(spec.preset.sampling)
        max_tokens = int(sampling.pop("max_tokens", cfg.n_predict))
        served = ServedModel(
            name=spec.name,
            engine=AsyncEngine(
                engine, max_queue=self.server_cfg.max_queue, turns=self._party(spec.name, "chat")
            ),
            vocab=runner.vocab,
            info=info,
            formatter=formatter,
            metrics=metrics,
            default_max_tokens=max_tokens,
            sampling=sampling,
            system=spec.preset.system,
            close_runner=runner.close,
            preparer=self.preparer,
            adapters=adapters,
            images=None if runner.images is None else EncodedImages(runner.images, metrics.images),
        )
        if cfg.pooling:  # a second context on the same (memory-mapped) weights
            try:
                second = self._embedding_runner(path, cfg, cfg.pooling)
            except Exception:
                runner.close()
                raise

            def close_both() -> None:
                runner.close()
                second.close()

            served.embedder = self._embedder(second, spec.name)
            served.close_runner = close_both
        return served

    async def unload(self, model: Loaded) -> None:
        if isinstance(model, ServedModel):
            await model.engine.stop()
        if model.embedder is not None:
            await model.embedder.stop()
        # The engine threads have ended and the lease rule kept every preparing request
        # away: nothing uses the runners or their vocabularies any more.
        await self._in_thread(model.close_runner)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    def estimate(self, spec: ModelSpec) -> int:
        cfg = self.engine_config(spec)
        return estimate_bytes(spec.locate(), cfg.ctx_size, cfg.cache_type_k, cfg.cache_type_v)

    def check(self, specs: list[ModelSpec]) -> None:
        """ValueError naming the flag for KV settings no context accepts, refused at start:
        a model whose preset's settings, with the flags', pair a quantized V with flash
        attention off; the default model (loaded at start) if a type's block does not divide
        its heads. Other models' heads are checked when they load."""
        for spec in specs:
            cfg = self.engine_config(spec)
            try:
                check_kv_settings(cfg.cache_type_k, cfg.cache_type_v, cfg.flash_attn)
                if spec is specs[0]:
                    _check_heads(spec.locate(), cfg)
            except ValueError as exc:
                raise ValueError(f"model {spec.name!r}: {exc}") from exc


def _check_heads(path: str, cfg: EngineConfig) -> None:
    try:
        facts = read_gguf(path)
    except InvalidModelFile:
        return  # its load says why, in the model's own words
    if not facts.is_embedding_model:
        check_head_sizes(cfg.cache_type_k, cfg.cache_type_v, facts.head_k, facts.head_v)


def build_server(
    engine_cfg: EngineConfig, server_cfg: ServerConfig, models_cfg: ModelsConfig
) -> tuple[FastAPI, str]:
    """The app (not yet started: models load on first use) and a startup line."""
    store = ModelStore(
        models_cfg.models_dir or default_models_dir(),
        max_bytes=parse_size(models_cfg.models_max_bytes),
    )
    specs = serve_specs(models_cfg.model, store, load_presets(models_cfg.presets), models_cfg.alias)
    specs = attach_adapters(specs, models_cfg.lora)
    specs = attach_stored(specs, store.list())
    specs = attach_projectors(specs, models_cfg.mmproj)
    metrics = ServerMetrics()
    # At most this many loads and unloads at once; more wait their turn.
    threads = ThreadPoolExecutor(4, "ferrum-load")
    loader = _Loader(engine_cfg, server_cfg, metrics, threads)
    loader.check(specs)
    registry: Registry[Loaded] = Registry(
        specs,
        loader.load,
        loader.unload,
        estimate=loader.estimate,
        keep_alive=parse_duration(models_cfg.keep_alive),
        max_models=models_cfg.max_models,
        memory_budget=memory_budget(models_cfg.memory_budget, engine_cfg.gpu_layers > 0),
        observer=metrics,
        threads=threads,
    )
    state = ServerState(
        models=registry,
        metrics=metrics,
        store=store,
        keys=Keys.from_config(
            server_cfg.api_key, server_cfg.admin_key, server_cfg.keys_file, server_cfg.open_admin
        ),
        public_metrics=server_cfg.public_metrics,
        webui=not server_cfg.no_webui,
        share_prefix_cache=server_cfg.share_prefix_cache,
        max_keep_alive=parse_duration(server_cfg.max_keep_alive),
        request_timeout=server_cfg.request_timeout,
        split_think=not server_cfg.reasoning_inline,
        responses_store_bytes=_store_bytes(server_cfg.responses_store),
        lora_dirs=models_cfg.lora_dirs,
    )
    if not state.keys.required:
        log.warning(
            "no API key: every client that can reach %s:%d may use the server%s (set "
            "--api-key and --admin-key, or --keys-file)",
            server_cfg.host,
            server_cfg.port,
            " and change its models (--open-admin)" if server_cfg.open_admin else "",
        )
    names = ", ".join(s.name for s in specs)
    summary = (
        f"ferrum serving {len(specs)} model(s) ({names}; default {registry.default}) "
        f"ctx={engine_cfg.ctx_size} parallel={engine_cfg.parallel} "
        f"threads={engine_cfg.resolved_threads()} on http://{server_cfg.host}:{server_cfg.port}"
    )
    return create_app(state), summary


def _store_bytes(size: str) -> int:
    """--responses-store as bytes: a size, or 0 / off for none."""
    return 0 if size.strip().lower() in ("0", "off", "none") else parse_size(size)


def _engine(runner: LlamaRunner, cfg: EngineConfig, path: str, metrics: Any) -> LLMEngine:
    """A chat model's engine on its runner, with the model's engine settings."""
    return LLMEngine(
        runner,
        block_size=cfg.block_size,
        observer=metrics,
        max_running=cfg.parallel,
        prefix_cache=not cfg.no_prefix_cache,
        speculation=SpecConfig.from_engine_config(cfg),
        prefill_cap=cfg.prefill_cap,
        decode_every=cfg.decode_every,
        tiers=TierConfig.for_model(
            cfg.cache_ram, cfg.cache_disk, cfg.cache_dir, path, runner.info.state_format
        ),
    )
