"""`ferrum cluster`'s settings: flags, a Serve config file's args, and what is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray")

from ferrum.cluster.app import settings_from_args  # noqa: E402
from ferrum.cluster.settings import ClusterConfig, ClusterSettings  # noqa: E402
from ferrum.config import EngineConfig, ModelsConfig, ServerConfig  # noqa: E402


def test_a_config_files_args_fill_every_part():
    s = settings_from_args(
        {
            "model": ["smollm2-135m-instruct"],
            "threads": 1,
            "ctx_size": 8192,
            "replicas": 3,
            "router": "text-prefix",
            "api_key": "k",
            "keep_alive": "1m",
        }  # fmt: skip
    )
    assert s.models.model == ("smollm2-135m-instruct",) and s.models.keep_alive == "1m"
    assert s.engine.threads == 1 and s.engine.ctx_size == 8192
    assert s.server.api_key == ("k",)
    assert s.cluster.replicas == 3 and s.cluster.router == "text-prefix"


def test_unknown_args_are_refused_by_name():
    with pytest.raises(ValueError, match="replicaz"):
        settings_from_args({"replicaz": 2})


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        (ClusterConfig(router="random"), "--router"),
        (ClusterConfig(replicas=0), "--replicas"),
        (ClusterConfig(min_replicas=3, max_replicas=2), "autoscaling"),
        (ClusterConfig(stats_period=0), "--stats-period"),
    ],
)
def test_bad_settings_are_refused(cluster, message):
    settings = ClusterSettings(EngineConfig(), ServerConfig(), ModelsConfig(), cluster)
    with pytest.raises(ValueError, match=message):
        settings.check()


def test_scaling_leaves_what_replicas_are_built_from_unchanged():
    a = ClusterSettings(EngineConfig(), ServerConfig(), ModelsConfig(), ClusterConfig(replicas=2))
    b = ClusterSettings(EngineConfig(), ServerConfig(), ModelsConfig(), ClusterConfig(replicas=5))
    assert a.without_scale() == b.without_scale()


def test_the_command_refuses_a_bad_router_in_one_line():
    cmd = [sys.executable, "-m", "ferrum.cli", "cluster", "--router", "random"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "ferrum: error: --router must be prefix, text-prefix or pow2"
    )
