"""One namespace: every module is ``kinfer.<package>...``, under one name only, and nothing is written
beside the code (an installed kinfer lives in site-packages)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import kinfer
from kinfer.ops.cli import build_parser, main
from kinfer.topics.paths import cache_dir, state_dir
from tests import ROOT

PACKAGES = ("topics", "producers", "consumers", "batcher", "ops")
# ``-m <package>.x`` in any file, or a quoted ``<package>.x`` module string in Python: the bare name.
BARE_DASH_M = re.compile(r"-m[\"',\s]+(?:" + "|".join(PACKAGES) + r")\.\w")
BARE_STRING = re.compile(r"[\"'](?:" + "|".join(PACKAGES) + r")\.[A-Za-z_]")
# An import statement in text, e.g. code for ``python -c`` in a string (ast sees only a string there).
BARE_IMPORT_TEXT = re.compile(r"\b(?:from\s+(?:" + "|".join(PACKAGES) + r")(?:\.\w+)*\s+import|import\s+(?:"
                              + "|".join(PACKAGES) + r"))\b")


def python_files() -> list[Path]:
    return sorted(p for folder in (*PACKAGES, "tests", "kinfer") for p in (ROOT / folder).rglob("*.py")
                  if "kinfer" not in p.relative_to(ROOT).parts[1:])  # kinfer/<pkg> is the same file again


def test_the_package_folders_are_kinfer_subpackages() -> None:
    for name in PACKAGES:
        link = ROOT / "kinfer" / name
        assert link.resolve() == (ROOT / name).resolve(), f"kinfer/{name} must lead to ../{name}"
    assert Path(kinfer.__file__).resolve().parent == (ROOT / "kinfer").resolve()


def test_no_module_imports_a_bare_package() -> None:
    """A bare ``topics`` next to ``kinfer.topics`` would load every file twice: two classes each."""
    bad = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in PACKAGES]
    assert bad == []


def test_no_command_or_module_string_names_a_bare_package() -> None:
    texts = {p: p.read_text() for p in python_files()}
    for name in ("Makefile", "Dockerfile", "docker-compose.yml", "README.md", ".ci/run"):
        texts[ROOT / name] = (ROOT / name).read_text()
    for doc in (ROOT / "docs").glob("*.md"):  # the commands the documentation tells users to run
        texts[doc] = doc.read_text()
    for p in [*(ROOT / "ops").rglob("*.sh"), *(ROOT / "ops").rglob("*.yaml"), *(ROOT / "ops").rglob("*.yml")]:
        texts[p] = p.read_text()
    bad = [f"{p.relative_to(ROOT)}: {m[0]}" for p, text in texts.items() for m in BARE_DASH_M.finditer(text)]
    bad += [f"{p.relative_to(ROOT)}: {m[0]}" for p, text in texts.items() if p.suffix == ".py"
            for pattern in (BARE_STRING, BARE_IMPORT_TEXT) for m in pattern.finditer(text)]
    assert bad == []


def test_the_distribution_installs_kinfer_alone() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"kinfer": "kinfer.ops.cli:main"}
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["kinfer", "kinfer.*"]
    assert project["tool"]["mypy"]["packages"] == ["kinfer"]


def test_the_command_line_parses_and_runs_from_another_folder(tmp_path: Path) -> None:
    args = build_parser().parse_args(["worker", "--model", "noop", "--family", "noop"])
    assert args.command == "worker"
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    # A fresh interpreter: the command line imports no module under a bare name (the repository root is on
    # its path, so a bare import would succeed and load a second copy).
    code = ("import sys; import kinfer.ops.cli; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {PACKAGES!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    out = subprocess.run([sys.executable, "-m", "kinfer.ops.cli", "--version"], cwd=tmp_path,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"kinfer {kinfer.__version__}"


def test_state_and_caches_are_per_user_and_follow_the_environment(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KINFER_HOME", "KINFER_CACHE", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert state_dir() == tmp_path / "user" / ".local" / "state" / "kinfer"
    assert cache_dir() == tmp_path / "user" / ".cache" / "kinfer"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert (state_dir(), cache_dir()) == (tmp_path / "state" / "kinfer", tmp_path / "user" / ".cache" / "kinfer")
    monkeypatch.setenv("KINFER_HOME", str(tmp_path / "home"))
    assert (state_dir(), cache_dir()) == (tmp_path / "home", tmp_path / "home")
    monkeypatch.setenv("KINFER_CACHE", str(tmp_path / "cache"))
    assert (state_dir(), cache_dir()) == (tmp_path / "home", tmp_path / "cache")


def test_nothing_defaults_to_a_folder_beside_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kinfer.consumers.runners.embedding import onnx_cache_root
    from kinfer.consumers.runners.registry import tiny_lm_path
    from kinfer.ops.localstack.stack import LocalStack

    for name in ("KINFER_HOME", "KINFER_CACHE", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    code = Path(kinfer.__file__).resolve().parent.parent
    for path in (LocalStack().home, tiny_lm_path(), onnx_cache_root(), cache_dir()):
        assert path.is_relative_to(tmp_path) and not path.resolve().is_relative_to(code), path
