"""`ferrum serve`: flags derived from the config dataclasses, each also `FERRUM_<NAME>`;
`ferrum pull|list|show|rm|cp|ps`: the model store (`ferrum.models.commands`);
`ferrum bench`: the benchmark harness (flags and run in `ferrum.bench.command`);
`ferrum cluster`: replicas on Ray Serve behind one ingress (`ferrum.cluster`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import typing
from collections.abc import Iterator
from typing import Any

import uvicorn

from ferrum.api.transport import header_deadline_protocol
from ferrum.bench.command import add_parser as add_bench_parser
from ferrum.cluster.settings import ClusterConfig, ClusterSettings
from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
from ferrum.errors import FerrumError, ModelLoadError
from ferrum.kv_types import check_kv_settings
from ferrum.models import commands as model_commands
from ferrum.models.catalog import with_alias

log = logging.getLogger("ferrum")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) is tuple


def _convert(tp: Any, raw: str) -> Any:
    """A flag's or variable's text as the config field's type (ValueError when it is not)."""
    if tp is bool:
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"{raw!r} is not a boolean (1/0, true/false, yes/no, on/off)")
        return word in _TRUE
    if _is_list(tp):
        return tuple(k.strip() for k in raw.split(",") if k.strip())
    if tp in (int, float, str):
        return tp(raw)
    raise TypeError(f"no flag type for {tp!r}")


def _env_default(name: str, tp: Any, default: Any) -> Any:
    var = f"FERRUM_{name.upper()}"
    raw = os.environ.get(var)
    if raw is None:
        return default
    try:
        return _convert(tp, raw)
    except ValueError as exc:
        raise ValueError(f"{var}: {exc}") from exc


def _add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    types = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, meta = types[f.name], f.metadata
        default = _env_default(f.name, tp, f.default)
        kw: dict[str, Any] = {
            "dest": f.name,
            "help": f"{meta['help']} [env FERRUM_{f.name.upper()}]",
        }
        if tp is bool:
            parser.add_argument(*meta["flags"], action="store_true", default=default, **kw)
        elif _is_list(tp):
            # Repeated or comma-separated; the variable's value unless a flag gives one.
            parser.add_argument(*meta["flags"], action="append", default=None, **kw)
            parser.set_defaults(**{f"_{f.name}_env": default})
        else:
            parser.add_argument(*meta["flags"], type=tp, default=default, **kw)


def _build(cls: type, ns: argparse.Namespace) -> Any:
    types = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        v = getattr(ns, f.name)
        if _is_list(types[f.name]):
            given = tuple(k for item in (v or []) for k in _convert(types[f.name], item))
            v = given or getattr(ns, f"_{f.name}_env")
        values[f.name] = v
    return cls(**values)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrum", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a GGUF model over an OpenAI-compatible API")
    _add_fields(serve, ModelsConfig)
    _add_fields(serve, EngineConfig)
    _add_fields(serve, ServerConfig)
    _add_lora_scaled(serve)
    cluster = sub.add_parser(
        "cluster", help="serve with replicas on Ray Serve, routed to the replica with the prefix"
    )
    for cls in (ModelsConfig, EngineConfig, ServerConfig, ClusterConfig):
        _add_fields(cluster, cls)
    model_commands.add_parsers(sub)
    add_bench_parser(sub)
    return parser


class _LoraScaled(argparse.Action):
    """llama-server's `--lora-scaled PATH SCALE`, kept in --lora's list as `PATH@SCALE` so
    that adapter ids follow the order of both flags together."""

    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, opt: Any = None) -> None:
        path, scale = values
        try:
            float(scale)
        except ValueError:
            parser.error(f"--lora-scaled {path} {scale}: the scale is not a number")
        items = list(getattr(ns, "lora", None) or [])
        ns.lora = [*items, f"{path}@{scale}"]


def _add_lora_scaled(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora-scaled",
        nargs=2,
        metavar=("PATH", "SCALE"),
        action=_LoraScaled,
        help="a LoRA adapter named after its file, at this scale (as --lora PATH@SCALE)",
    )


def _check_keys(args: argparse.Namespace) -> None:
    """A key flag given but empty (`--api-key ","`) would silently run the server open."""
    for name in ("api_key", "admin_key"):
        given = list(getattr(args, name) or [])
        env = os.environ.get(f"FERRUM_{name.upper()}")
        if getattr(args, name) is None and env is not None:
            given.append(env)
        if given and not any(k.strip() for item in given for k in item.split(",")):
            raise ValueError(f"--{name.replace('_', '-')} was given but holds no key")


def _check(engine: EngineConfig, models: ModelsConfig) -> None:
    with_alias(models.model, models.alias)  # refused at start, not when the models resolve
    if models.max_models < 0:
        raise ValueError("--max-models must be 0 (no limit) or more")
    for name in ("ctx_size", "parallel", "batch_size", "block_size"):
        if getattr(engine, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if engine.ctx_size < engine.block_size:
        raise ValueError("--ctx-size must hold at least one block")
    if engine.split_prefill < 0 or engine.prefill_cap < 0:
        raise ValueError("--split-prefill and --prefill-cap must be 0 (off) or more")
    if not 0.0 <= engine.inject_faults <= 1.0:
        raise ValueError("--inject-faults must be between 0 and 1")
    if engine.spec_type not in ("ngram", "none"):
        raise ValueError("--spec-type must be ngram or none")
    if engine.engine_turns not in ("shared", "off"):
        raise ValueError("--engine-turns must be shared or off")
    if not 1 <= engine.spec_ngram_min <= engine.spec_ngram_max:
        raise ValueError("--spec-ngram-min must be at least 1 and at most --spec-ngram-max")
    if engine.spec_draft_max < 0 or engine.spec_batch_max < 0 or engine.spec_recent < 0:
        raise ValueError("--spec-draft-max, --spec-batch-max and --spec-recent must be 0 or more")
    check_kv_settings(engine.cache_type_k, engine.cache_type_v, engine.flash_attn)


def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig, models_cfg: ModelsConfig) -> None:
    from ferrum.server import build_server

    app, summary = build_server(engine_cfg, server_cfg, models_cfg)
    log.info("%s", summary)
    server = _GracefulServer(uvicorn_config(app, server_cfg))
    server.run()
    if not server.started:  # the default model failed to load (logged): nothing was served
        raise ModelLoadError("the server did not start; see the log above")


def uvicorn_config(app: Any, server_cfg: ServerConfig) -> uvicorn.Config:
    """How `ferrum serve` runs uvicorn: its address, logs, grace, and a deadline on request
    heads (`ferrum.api.transport`); idle connections between requests are closed by uvicorn's
    own keep-alive timeout."""
    timeout = server_cfg.header_timeout
    return uvicorn.Config(
        app,
        host=server_cfg.host,
        port=server_cfg.port,
        log_level=server_cfg.log_level,
        access_log=server_cfg.log_level == "debug",
        timeout_graceful_shutdown=math.ceil(server_cfg.shutdown_grace),
        http=header_deadline_protocol(timeout) if timeout > 0 else "auto",
    )


def _cluster(settings: ClusterSettings) -> None:
    try:
        from ferrum.cluster.command import run
    except ImportError as exc:  # Ray is an optional extra
        raise ValueError(
            f"ferrum cluster needs Ray ({exc}): pip install 'ferrum[cluster]'"
        ) from exc
    settings.check()
    run(settings)


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, minus its re-raising of SIGTERM/SIGINT after the graceful shutdown
    (which makes the process die with -15): a server stopped on purpose exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> None:
    try:
        parser = make_parser()
    except ValueError as exc:  # a FERRUM_* variable that does not parse
        print(f"ferrum: error: {exc}", file=sys.stderr)
        sys.exit(2)
    args = parser.parse_args(argv)
    if args.command == "bench":
        # Imported here: the harness needs the optional `bench` extra, `serve` does not.
        from ferrum.bench.command import run as run_bench

        sys.exit(run_bench(args))
    if args.command not in ("serve", "cluster"):
        sys.exit(model_commands.run(args))
    engine_cfg = _build(EngineConfig, args)
    server_cfg = _build(ServerConfig, args)
    models_cfg = _build(ModelsConfig, args)
    logging.basicConfig(
        level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        _check_keys(args)
        _check(engine_cfg, models_cfg)
        if args.command == "cluster":
            _cluster(
                ClusterSettings(engine_cfg, server_cfg, models_cfg, _build(ClusterConfig, args))
            )
        else:
            serve(engine_cfg, server_cfg, models_cfg)
    except (FerrumError, ValueError, OSError) as exc:
        print(f"ferrum: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
