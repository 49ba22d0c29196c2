"""`ferrum pull|list|show|rm|cp|ps` as a user runs them: real processes against the fake hub
for pull and the error exit, in-process runs (`commands.run`) for the rest."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ferrum.models import commands
from ferrum.models.store import ModelStore, slug
from tests.models.conftest import LLAMA, SPLIT, store_tree
from tests.models.fake_hub import FakeHub

ROOT = Path(__file__).resolve().parents[2]


def _cli_env(hub: FakeHub, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    return env | {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf-home"),
        "FERRUM_MODELS_DIR": str(tmp_path / "models"),
        "PYTHONPATH": str(ROOT),
    }


def _spawn(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ferrum.models.commands", *args],
        cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def _cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = _spawn(env, *args)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    commands.add_parsers(parser.add_subparsers(dest="command", required=True))
    code = commands.run(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_pull_list_show_rm_as_a_user_runs_them(hub: FakeHub, tmp_path: Path) -> None:
    env = _cli_env(hub, tmp_path)
    code, out, err = _cli(env, "pull", LLAMA)
    assert code == 0, err
    assert out == f"pulled {LLAMA}:Q4_K_M (670 KB)\n"
    assert f"using {LLAMA}:Q4_K_M (available: Q4_K_M, Q8_0)" in err and "success" in err
    code, out, _ = _cli(env, "list")
    header, row = out.splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "ADDED"]
    manifest = ModelStore(tmp_path / "models").get(f"{LLAMA}:Q4_K_M")
    assert row.split()[:4] == [manifest.name, manifest.sha256[:12], "670", "KB"]
    code, out, _ = _cli(env, "show", LLAMA)  # the only tag of the repository
    assert code == 0
    lines = [line.split(None, 1) for line in out.splitlines()]
    assert ["architecture", "llama"] in lines and ["quantization", "Q4_K_M"] in lines
    assert ["file", manifest.files[0]] in lines
    assert "  context length  2048" in out and "  chat template   yes" in out
    code, out, _ = _cli(env, "rm", f"{LLAMA}:Q4_K_M")
    assert (code, out) == (0, f"deleted {LLAMA}:Q4_K_M\n")
    assert _cli(env, "list")[1].split() == ["NAME", "ID", "SIZE", "ADDED"]
    assert store_tree(ModelStore(tmp_path / "models")) == set()


def test_errors_are_one_line_and_exit_2(hub: FakeHub, tmp_path: Path) -> None:
    code, out, err = _cli(_cli_env(hub, tmp_path), "pull", f"{LLAMA}:Q3_K_S")
    assert (code, out) == (2, "")
    # The progress lines so far, then the error on one line.
    assert err.splitlines() == [
        "pulling manifest",
        f"ferrum: error: model '{LLAMA}:Q3_K_S' not found; "
        f"available: '{LLAMA}:Q4_K_M', '{LLAMA}:Q8_0'",
    ]


def test_two_processes_pulling_one_model(hub: FakeHub, tmp_path: Path) -> None:
    env = _cli_env(hub, tmp_path)
    procs = [_spawn(env, "pull", SPLIT) for _ in range(2)]
    results = [(p.wait(timeout=60), p.stdout.read() if p.stdout else "") for p in procs]
    assert results == [(0, f"pulled {SPLIT}:Q4_K_M (671 KB)\n")] * 2
    assert len(hub.requests("GET", "/cdn/")) == 3
    (m,) = ModelStore(tmp_path / "models").list()
    assert len(m.files) == 3 and all(Path(f).is_file() for f in m.files)


def test_cp_and_rm_in_process(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = ["--models-dir", str(tmp_path / "m")]
    assert _run(capsys, "pull", f"{LLAMA}:Q8_0", "--name", "tiny", *d)[0] == 0
    assert _run(capsys, "cp", "tiny", "copy", *d)[1] == "copied tiny to copy\n"
    code, out, _ = _run(capsys, "rm", "tiny", *d)
    assert (code, out) == (0, "deleted tiny\n")
    code, out, _ = _run(capsys, "show", "copy", *d)
    assert code == 0 and "copy:tiny" in out
    code, out, err = _run(capsys, "rm", "tiny", *d)
    assert (code, out) == (2, "") and err.startswith("ferrum: error: model 'tiny' not found")
    assert err.count("\n") == 1


def test_list_ignores_a_corrupted_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    store = ModelStore(tmp_path)
    (store.manifests / f"{slug('broken')}.json").write_text("{not json")
    code, out, _ = _run(capsys, "list", "--models-dir", str(tmp_path))
    assert code == 0 and out.split() == ["NAME", "ID", "SIZE", "ADDED"]
    assert "unreadable model manifest" in caplog.text


class _PsHandler(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/api/ps" else 404)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_ps_shows_what_a_server_has_loaded(capsys: pytest.CaptureFixture[str]) -> None:
    soon = datetime.fromtimestamp(time.time() + 301, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f123Z")
    models = [
        {"name": "smollm2-135m-instruct", "model": "smollm2-135m-instruct", "size": 270_000_000,
         "size_vram": 0, "expires_at": soon, "details": {"format": "gguf"},
         "kv_cache": {"type_k": "q8_0", "type_v": "q4_0", "flash_attn": "on"}},
        {"name": "org/repo:Q8_0", "model": "org/repo:Q8_0", "size": 1_500_000_000,
         "size_vram": 0, "expires_at": "2318-01-01T00:00:00Z", "details": {}},
        {"name": "busy", "model": "busy", "size": 512, "expires_at": None, "details": {}},
    ]  # fmt: skip
    _PsHandler.body = json.dumps({"models": models}).encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PsHandler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        code, out, _ = _run(capsys, "ps", "--url", url)
    finally:
        server.shutdown()
        server.server_close()
    assert code == 0
    assert [line.split() for line in out.splitlines()] == [
        ["NAME", "SIZE", "KV", "UNTIL"],
        ["smollm2-135m-instruct", "270", "MB", "q8_0/q4_0", "in", "5", "minutes"],
        ["org/repo:Q8_0", "1.5", "GB", "-", "forever"],
        ["busy", "512", "B", "-", "-"],
    ]
    code, out, err = _run(capsys, "ps", "--url", "http://127.0.0.1:9")
    assert (code, out) == (2, "") and err.startswith("ferrum: error: cannot reach the server")


def test_cp_and_pull_refuse_a_built_in_model_s_name(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = ["--models-dir", str(tmp_path / "m")]
    assert _run(capsys, "pull", f"{LLAMA}:Q8_0", "--name", "tiny", *d)[0] == 0
    for dest in ("gemma3-270m", "SmolLM2-135M-Instruct:latest"):
        code, out, err = _run(capsys, "cp", "tiny", dest, *d)
        assert (code, out) == (2, "") and f"{dest!r} is a built-in model's name" in err
        code, _, err = _run(capsys, "pull", f"{LLAMA}:Q8_0", "--name", dest, *d)
        assert code == 2 and f"{dest!r} is a built-in model's name" in err
    assert [m.name for m in ModelStore(tmp_path / "m").list()] == ["tiny"]
