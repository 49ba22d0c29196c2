"""The Ray Serve application: an ingress deployment in front of a deployment of ferrum
replicas, routed by the chosen router.

`build_app(settings)` is what `ferrum cluster` runs; `app_builder(args)` is the same for
Ray users' `serve run` / `serve deploy` config files (`import_path:
ferrum.cluster.app:app_builder`, `args:` taking `ferrum serve`'s and `ferrum cluster`'s
flag names, see docs/cluster.md).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from ferrum.cluster.ingress import FerrumIngress
from ferrum.cluster.replica import FerrumReplica
from ferrum.cluster.routers import ROUTERS
from ferrum.cluster.settings import ClusterConfig, ClusterSettings
from ferrum.config import EngineConfig, ModelsConfig, ServerConfig


def build_app(settings: ClusterSettings) -> Application:
    settings.check()
    c = settings.cluster
    # Ray declares its config models with pydantic v1, which mypy reads as **data: dict.
    router_fields: dict[str, Any] = {
        "request_router_class": ROUTERS[c.router],
        "request_router_kwargs": {"imbalance": c.route_imbalance} if c.router == "prefix" else {},
        "request_routing_stats_period_s": c.stats_period,
        "request_routing_stats_timeout_s": max(5.0, 5 * c.stats_period),
    }
    router = RequestRouterConfig(**router_fields)
    options: dict[str, Any] = {
        "name": "FerrumReplica",
        "request_router_config": router,
        # ferrum queues and batches itself: Ray should not hold requests back from it.
        "max_ongoing_requests": settings.engine.parallel + settings.server.max_queue,
        "graceful_shutdown_timeout_s": c.drain_timeout,
        "health_check_period_s": 5,
        "ray_actor_options": {
            "num_cpus": c.replica_cpus or settings.engine.resolved_threads(),
            "num_gpus": c.replica_gpus,
        },
    }
    if c.min_replicas:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=c.min_replicas,
            max_replicas=c.max_replicas,
            target_ongoing_requests=c.target_ongoing_requests,
        )
    else:
        options["num_replicas"] = c.replicas
    replicas = serve.deployment(**options)(FerrumReplica).bind(settings.without_scale())
    ingress = serve.deployment(
        name="FerrumIngress",
        max_ongoing_requests=1_000_000,  # a relay: limits are the replicas'
        # A redeploy replaces the ingress too: it relays the streams the replicas drain, so
        # it waits as long as they do (Ray's default, 20 s, cut long answers mid-stream).
        graceful_shutdown_timeout_s=c.drain_timeout,
        ray_actor_options={"num_cpus": 0},
    )(FerrumIngress)
    app: Application = ingress.bind(replicas, settings.without_scale())
    return app


def settings_from_args(args: dict[str, Any]) -> ClusterSettings:
    """Settings from a config file's `args`: each key a field of `ferrum serve`'s or
    `ferrum cluster`'s configs (the flag's name with underscores); unknown keys refused."""
    parts: dict[str, Any] = {}
    left = dict(args)
    for name, cls in (
        ("engine", EngineConfig),
        ("server", ServerConfig),
        ("models", ModelsConfig),
        ("cluster", ClusterConfig),
    ):
        types = typing.get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in left:
                value = left.pop(f.name)
                if typing.get_origin(types[f.name]) is tuple:
                    value = tuple([value] if isinstance(value, str) else value)
                values[f.name] = value
        parts[name] = cls(**values)
    if left:
        raise ValueError(f"unknown ferrum settings: {', '.join(sorted(left))}")
    return ClusterSettings(**parts)


def app_builder(args: dict[str, Any]) -> Application:
    return build_app(settings_from_args(args))
