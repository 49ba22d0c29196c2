"""Dependencies point one way (STYLE.md): only the runner imports llama_cpp; only the API,
metrics and composition root import FastAPI / prometheus_client; the engine never imports
the API."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "ferrum"


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _who_imports(prefix: str) -> set[str]:
    return {
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if any(n == prefix or n.startswith(prefix + ".") for n in _imports(p))
    }


def test_only_the_runner_imports_llama_cpp():
    assert _who_imports("llama_cpp") == {"engine/runner.py", "engine/sampler.py"}


def test_web_and_metrics_libraries_stay_at_the_edge():
    web = _who_imports("fastapi") | _who_imports("starlette") | _who_imports("uvicorn")
    assert web <= {"api/app.py", "api/serving.py", "server.py", "cli.py"}
    assert _who_imports("prometheus_client") == {"metrics.py"}


def test_engine_does_not_import_api_or_server():
    for p in (ROOT / "engine").glob("*.py"):
        bad = {
            n
            for n in _imports(p)
            if n.startswith(("ferrum.api", "ferrum.server", "ferrum.metrics"))
        }
        assert not bad, f"{p.name} imports {bad}"
