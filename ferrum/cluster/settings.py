"""`ferrum cluster`'s own flags (the rest are `ferrum serve`'s), and everything a replica and
the ingress are built from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ferrum.config import EngineConfig, ModelsConfig, ServerConfig


def _flag(*names: str, help: str) -> dict[str, Any]:
    return {"flags": names, "help": help}


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = field(
        default=2, metadata=_flag("--replicas", help="replicas (one ferrum engine each)")
    )
    min_replicas: int = field(
        default=0,
        metadata=_flag(
            "--min-replicas", help="autoscale between this and --max-replicas (0: fixed count)"
        ),
    )
    max_replicas: int = field(
        default=0, metadata=_flag("--max-replicas", help="upper bound when autoscaling")
    )
    target_ongoing_requests: float = field(
        default=4.0,
        metadata=_flag(
            "--target-ongoing-requests", help="requests per replica the autoscaler aims at"
        ),
    )
    address: str = field(
        default="",
        metadata=_flag(
            "--address", help="a Ray cluster to join (e.g. ray://head:10001); none: a local one"
        ),
    )
    router: str = field(
        default="prefix",
        metadata=_flag(
            "--router",
            help="prefix (the replica holding the prompt's blocks), text-prefix (Ray Serve "
            "LLM's PrefixCacheAffinityRouter policy) or pow2 (Ray Serve's default)",
        ),
    )
    route_imbalance: int = field(
        default=4,
        metadata=_flag(
            "--route-imbalance",
            help="prefix router: requests in flight beyond the least loaded replica's at "
            "which a prefix holder is passed over",
        ),
    )
    route_summary_blocks: int = field(
        default=8192,
        metadata=_flag(
            "--route-summary-blocks",
            help="most prefix block hashes a replica reports per model (8 bytes each)",
        ),
    )
    stats_period: float = field(
        default=1.0,
        metadata=_flag("--stats-period", help="seconds between replicas' routing summaries"),
    )
    replica_cpus: float = field(
        default=0.0,
        metadata=_flag("--replica-cpus", help="Ray CPUs per replica (0: --threads)"),
    )
    replica_gpus: float = field(
        default=0.0, metadata=_flag("--replica-gpus", help="Ray GPUs per replica")
    )
    drain_timeout: float = field(
        default=300.0,
        metadata=_flag(
            "--drain-timeout",
            help="seconds a replica being removed may take to finish its requests",
        ),
    )
    app_name: str = field(
        default="ferrum", metadata=_flag("--app-name", help="the Ray Serve application's name")
    )


@dataclass(frozen=True)
class ClusterSettings:
    engine: EngineConfig
    server: ServerConfig
    models: ModelsConfig
    cluster: ClusterConfig = ClusterConfig()

    def without_scale(self) -> ClusterSettings:
        """The settings a replica and the ingress are built from: the replica count left out,
        so that scaling changes only the count (Ray restarts every replica whose
        constructor's arguments change)."""
        scale = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests")
        defaults = {name: getattr(ClusterConfig, name) for name in scale}
        return dataclasses.replace(self, cluster=dataclasses.replace(self.cluster, **defaults))

    def check(self) -> None:
        c = self.cluster
        if c.router not in ("prefix", "text-prefix", "pow2"):
            raise ValueError("--router must be prefix, text-prefix or pow2")
        if c.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if (c.min_replicas or c.max_replicas) and not 0 < c.min_replicas <= c.max_replicas:
            raise ValueError("autoscaling needs 0 < --min-replicas <= --max-replicas")
        if c.stats_period <= 0 or c.route_summary_blocks < 0:
            raise ValueError("--stats-period must be positive, --route-summary-blocks >= 0")
