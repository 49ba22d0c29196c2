"""The servers under test ("arms"): their command lines, and starting and stopping them.

Every started arm gets the same model file, threads and KV shape: one pool of `ctx_size`
cells that any single sequence may fill (ferrum's unified KV; llama-server `--kv-unified`;
llama-cpp-python has one sequence of `n_ctx`). Beyond that each keeps its own defaults.
One server runs at a time (`process.ServerProcess`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ferrum.bench.client import Dialect
from ferrum.bench.settings import BenchSettings

ARM_KINDS = ("ferrum", "llama-server", "llama-server-default", "llama-cpp-python", "url")
# llama-server as its users build it (cmake defaults: -march=native), beside the build with
# ferrum's own kernel flags ("llama-server"). Each kind's build flavor:
LLAMA_SERVER_FLAVORS = {"llama-server": "same", "llama-server-default": "default"}


def build_hint(flavor: str = "same") -> str:
    """How to build llama.cpp's binaries of `flavor` (bench/build_llama_server.sh's FLAVOR)."""
    env = "" if flavor == "same" else f"FLAVOR={flavor} "
    return f"build it with {env}bench/build_llama_server.sh (in a ferrum checkout)"


@dataclass(frozen=True)
class Arm:
    label: str
    kind: str
    serial: bool  # answers one request at a time (llama-cpp-python's server)
    dialect: Dialect
    ready_path: str = "/health"
    url: str = ""  # only for kind "url": the server is not ours to start


def cache_dir() -> Path:
    """The bench's own files outside any checkout: llama.cpp builds, generated adapters."""
    return Path(os.environ.get("FERRUM_BENCH_CACHE", Path.home() / ".cache" / "ferrum-bench"))


def llama_cpp_build_dir(flavor: str = "same") -> Path:
    """Where bench/build_llama_server.sh puts llama.cpp's binaries for the installed pin:
    built with ferrum's kernel flags ("same"), or with cmake's defaults ("default")."""
    cache = cache_dir()
    version = importlib.metadata.version("llama-cpp-python")
    suffix = "" if flavor == "same" else f"-{flavor}"
    return cache / f"build-{version}{suffix}" / "bin"


def unavailable_reason(kind: str) -> str | None:
    """Why an arm cannot run on this machine, or None."""
    if kind in LLAMA_SERVER_FLAVORS:
        flavor = LLAMA_SERVER_FLAVORS[kind]
        binary = llama_cpp_build_dir(flavor) / "llama-server"
        if not binary.is_file():
            return f"no {binary}; {build_hint(flavor)}"
    if kind == "llama-cpp-python":
        missing = [
            m
            for m in ("sse_starlette", "starlette_context", "pydantic_settings")
            if importlib.util.find_spec(m) is None
        ]
        if missing:
            return f"its server needs {', '.join(missing)}: pip install 'ferrum[bench]'"
    return None


def make_arm(kind: str, label: str, url: str = "", eog: tuple[int, ...] = ()) -> Arm:
    if kind == "ferrum" or kind in LLAMA_SERVER_FLAVORS:
        return Arm(label, kind, serial=False, dialect=Dialect())
    if kind == "llama-cpp-python":
        # No ignore_eos field and no usage in streams; /health does not exist.
        dialect = Dialect(ignore_eos="logit_bias", eog_token_ids=eog, usage_in_stream=False)
        return Arm(label, kind, serial=True, dialect=dialect, ready_path="/v1/models")
    if kind == "url":
        base = url.rstrip("/").removesuffix("/v1")
        return Arm(label, kind, serial=False, dialect=Dialect(), ready_path="/v1/models", url=base)
    raise ValueError(f"unknown arm {kind!r}; choose from {', '.join(ARM_KINDS)}")


def server_command(
    arm: Arm, s: BenchSettings, model: str, port: int, state_dir: Path | None = None
) -> list[str]:
    """The arm's command line. `state_dir`: ferrum's disk tier, a folder of its own per start
    (the prompts are the same in every run, seeded by round, so the default folder would
    serve a later run the states an earlier one saved)."""
    t, c, p = str(s.threads), str(s.ctx_size), str(port)
    if arm.kind == "ferrum":
        cmd = [sys.executable, "-m", "ferrum.cli", "serve", "--model", model, "--port", p]
        cmd += ["--threads", t, "--parallel", str(s.parallel), "--ctx-size", c]
        cmd += ["--cache-dir", str(state_dir)] if state_dir is not None else []
        return [*cmd, "--log-level", "warning"]
    if arm.kind in LLAMA_SERVER_FLAVORS:
        binary = llama_cpp_build_dir(LLAMA_SERVER_FLAVORS[arm.kind]) / "llama-server"
        cmd = [str(binary), "-m", model, "--port", p]
        cmd += ["-t", t, "-tb", t, "-np", str(s.parallel), "-c", c]
        # --kv-unified: one shared cell pool like ferrum's, instead of ctx/np cells per slot
        # (`peer_kv_unified=0`: as llama-server runs by default, each slot its own cells).
        # --log-verbosity 2: warnings and errors only (no per-request info lines).
        unified = ["--kv-unified"] if s.peer_kv_unified else []
        return [*cmd, *unified, "--no-webui", "--log-verbosity", "2"]
    if arm.kind == "llama-cpp-python":
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--port", p]
        cmd += ["--n_ctx", c, "--n_threads", t, "--n_threads_batch", t]
        cmd += ["--n_batch", "512", "--n_ubatch", "512"]
        # flash_attn: what "auto" resolves to on CPU for the other arms. logits_all defaults
        # to True in its server, which copies n_vocab logits for every prompt token (262k for
        # Gemma 3) into a numpy array of n_ctx rows: not a configuration anyone would run.
        # interrupt_requests: by default a new request cancels the one streaming, which would
        # make every concurrent workload measure cancellations.
        cmd += ["--flash_attn", "true", "--logits_all", "false"]
        return [*cmd, "--interrupt_requests", "false", "--verbose", "false"]
    raise ValueError(f"arm kind {arm.kind!r} is not started by the benchmark")
