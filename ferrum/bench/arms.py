"""The servers under test ("arms"): their command lines, and starting and stopping them.

Every started arm gets the same model file, threads and KV shape: one pool of `ctx_size`
cells that any single sequence may fill (ferrum's unified KV; llama-server `--kv-unified`;
llama-cpp-python has one sequence of `n_ctx`). Beyond that each keeps its own defaults.
One server runs at a time: `ServerProcess.stop` waits until the port is free again.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ferrum.bench.client import Dialect
from ferrum.bench.settings import BenchSettings

ARM_KINDS = ("ferrum", "llama-server", "llama-cpp-python", "url")
BUILD_HINT = "build it with bench/build_llama_server.sh (in a ferrum checkout)"


@dataclass(frozen=True)
class Arm:
    label: str
    kind: str
    serial: bool  # answers one request at a time (llama-cpp-python's server)
    dialect: Dialect
    ready_path: str = "/health"
    url: str = ""  # only for kind "url": the server is not ours to start


def llama_cpp_build_dir() -> Path:
    """Where bench/build_llama_server.sh puts llama.cpp's binaries for the installed pin."""
    cache = Path(os.environ.get("FERRUM_BENCH_CACHE", Path.home() / ".cache" / "ferrum-bench"))
    version = importlib.metadata.version("llama-cpp-python")
    return cache / f"build-{version}" / "bin"


def unavailable_reason(kind: str) -> str | None:
    """Why an arm cannot run on this machine, or None."""
    if kind == "llama-server" and not (llama_cpp_build_dir() / "llama-server").is_file():
        return f"no {llama_cpp_build_dir() / 'llama-server'}; {BUILD_HINT}"
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
    if kind == "ferrum":
        return Arm(label, kind, serial=False, dialect=Dialect())
    if kind == "llama-server":
        return Arm(label, kind, serial=False, dialect=Dialect())
    if kind == "llama-cpp-python":
        # No ignore_eos field and no usage in streams; /health does not exist.
        dialect = Dialect(ignore_eos="logit_bias", eog_token_ids=eog, usage_in_stream=False)
        return Arm(label, kind, serial=True, dialect=dialect, ready_path="/v1/models")
    if kind == "url":
        base = url.rstrip("/").removesuffix("/v1")
        return Arm(label, kind, serial=False, dialect=Dialect(), ready_path="/v1/models", url=base)
    raise ValueError(f"unknown arm {kind!r}; choose from {', '.join(ARM_KINDS)}")


def server_command(arm: Arm, s: BenchSettings, model: str, port: int) -> list[str]:
    t, c, p = str(s.threads), str(s.ctx_size), str(port)
    if arm.kind == "ferrum":
        cmd = [sys.executable, "-m", "ferrum.cli", "serve", "--model", model, "--port", p]
        cmd += ["--threads", t, "--parallel", str(s.parallel), "--ctx-size", c]
        return [*cmd, "--log-level", "warning"]
    if arm.kind == "llama-server":
        cmd = [str(llama_cpp_build_dir() / "llama-server"), "-m", model, "--port", p]
        cmd += ["-t", t, "-tb", t, "-np", str(s.parallel), "-c", c]
        # --kv-unified: one shared cell pool like ferrum's, instead of ctx/np cells per slot.
        # --log-verbosity 2: warnings and errors only (no per-request info lines).
        return [*cmd, "--kv-unified", "--no-webui", "--log-verbosity", "2"]
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


# ------------------------------------------------------------------ processes


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_port_free(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not port_is_free(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} still busy after {timeout:.0f} s")
        time.sleep(0.2)


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """One started server, in its own session so that its whole process group can be
    signalled (and its CPU time counted) at once."""

    def __init__(self, cmd: list[str], log_path: Path, port: int):
        self.cmd, self.log_path, self.port = cmd, log_path, port
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, base: str, path: str, timeout: float = 300.0) -> float:
        """Polls `path` until 200 (llama-server answers 503 while loading); seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                tail = log_tail(self.log_path)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(base + path, timeout=2.0).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{path} not OK after {timeout:.0f} s:\n{log_tail(self.log_path)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        wait_port_free(self.port)
