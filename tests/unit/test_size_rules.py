"""The size rules of /work/shared/STYLE.md, kept true: no function in ferrum/ over 60 lines and
no file over 450. The tree is walked, not listed, so a file added or moved is checked too."""

from __future__ import annotations

import ast
from pathlib import Path

FERRUM = Path(__file__).resolve().parents[2] / "ferrum"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 450


def oversized(root: Path) -> list[str]:
    """Every file under `root` longer than MAX_FILE_LINES and every function (nested ones on
    their own, decorators not counted) longer than MAX_FUNCTION_LINES, with its length."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        lines = len(source.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{path} ({lines} lines)")
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_ferrum_keeps_its_functions_and_files_small():
    assert FERRUM.is_dir()
    assert not oversized(FERRUM), "split these (STYLE.md):\n" + "\n".join(oversized(FERRUM))


def test_the_check_finds_a_long_function_and_a_long_file_anywhere_in_the_tree(tmp_path):
    package = tmp_path / "deep" / "er"
    package.mkdir(parents=True)
    body = "    x = 1\n" * (MAX_FUNCTION_LINES - 1)
    (package / "fits.py").write_text(f"@decorated\ndef f():\n{body}")
    (package / "long.py").write_text(f"async def g():\n{body}    return x\n")
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert oversized(tmp_path) == [
        f"{tmp_path / 'big.py'} ({MAX_FILE_LINES + 1} lines)",
        f"{package / 'long.py'}:1 g ({MAX_FUNCTION_LINES + 1} lines)",
    ]


ROOT = FERRUM.parent
MARKERS = ("<<<<<<< ", ">>>>>>> ")


def conflict_markers(paths: list[Path]) -> list[str]:
    """Lines that open or close a merge conflict, as `path:line`."""
    return [
        f"{path}:{n}"
        for path in paths
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if line.startswith(MARKERS)
    ]


def test_no_merge_left_half_resolved_in_the_docs_or_code():
    # A conflict in a Markdown table once sat on main for a session: nothing else reads it.
    paths = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *FERRUM.rglob("*.py")]
    assert not conflict_markers(paths), "resolve:\n" + "\n".join(conflict_markers(paths))


def test_the_marker_check_finds_a_conflict(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("| a |\n<<<<<<< HEAD\n| b |\n=======\n| c |\n>>>>>>> other\n")
    assert conflict_markers([doc]) == [f"{doc}:2", f"{doc}:6"]
