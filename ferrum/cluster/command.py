"""`ferrum cluster`: the application on a local Ray instance (or `--address`'s cluster),
served on `--host`/`--port` until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import threading

import ray
from ray import serve

from ferrum.cluster.app import build_app
from ferrum.cluster.settings import ClusterSettings

log = logging.getLogger("ferrum.cluster")


def run(settings: ClusterSettings) -> None:
    c = settings.cluster
    per_replica = c.replica_cpus or settings.engine.resolved_threads()
    replicas = max(c.replicas, c.max_replicas)
    if c.address:
        ray.init(address=c.address, logging_level=logging.WARNING)
    else:
        cpus = os.cpu_count() or 1
        need = per_replica * replicas
        if need > cpus:
            log.warning(
                "%d replicas x %g CPUs is more than this machine's %d: they will share cores",
                replicas,
                per_replica,
                cpus,
            )
        ray.init(
            num_cpus=max(cpus, int(need + 0.999)),
            include_dashboard=False,
            object_store_memory=256 * 1024 * 1024,
            logging_level=logging.WARNING,
        )
    stop = threading.Event()
    try:
        serve.start(http_options={"host": settings.server.host, "port": settings.server.port})
        serve.run(build_app(settings), name=c.app_name, route_prefix="/")
        # Only now: until the application runs, Ctrl-C interrupts the deployment itself.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        log.info(
            "ferrum cluster: %s on http://%s:%d (%s router)",
            f"{c.min_replicas}-{c.max_replicas} replicas"
            if c.min_replicas
            else f"{c.replicas} replicas",
            settings.server.host,
            settings.server.port,
            c.router,
        )
        stop.wait()
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
