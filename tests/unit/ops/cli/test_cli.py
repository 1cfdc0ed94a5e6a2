"""Common mistakes end in one line that says what to do, exit code 2, not a traceback."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import kinfer
from kinfer.ops.cli import build_parser, main
from kinfer.ops.cli.reference import REGENERATE, render


@pytest.mark.parametrize(("argv", "says"), [
    (["worker", "--model", "nope"], "unknown model 'nope': pass --family/--path, or use one of"),
    (["worker", "--model", "x", "--family", "embedding", "--path", "/nonexistent"], "--path /nonexistent: no such"),
    (["infer", "--model", "minilm", "text"], "Kafka at 127.0.0.1:1 unreachable"),
    (["gateway", "--port", "1"], "Kafka at 127.0.0.1:1 unreachable"),
])
def test_mistakes_say_what_to_do(argv: list[str], says: str, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KINFER_BOOTSTRAP", "127.0.0.1:1")  # nothing listens there
    monkeypatch.setenv("KINFER_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delenv("KINFER_DEBUG", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"kinfer {argv[0]}: " in err and says in err and "Traceback" not in err


def test_a_malformed_tenants_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KINFER_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("KINFER_REDIS_URL", "redis://127.0.0.1:1/0")
    for text in ("not json", '{"tenant": []}', '{"tenants": [{"name": "a"}]}'):
        (tmp_path / "t.json").write_text(text)
        assert main(["gateway", "--tenants", str(tmp_path / "t.json")]) == 2
        assert f"{tmp_path / 't.json'}: not a tenants file" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("kinfer ")


def test_any_failure_is_one_line_unless_debug(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KINFER_DEBUG", raising=False)
    bad = tmp_path / "models.yaml"
    bad.write_text("models: [name: {")
    assert main(["simulate", "--models", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kinfer simulate: {bad}: not JSON or YAML") and "Traceback" not in err
    # Something nobody foresaw: still one line, naming what it was, and --debug shows where.
    monkeypatch.setattr("kinfer.ops.capacity.simulate.load_models", lambda path: [][0])
    assert main(["simulate"]) == 1
    err = capsys.readouterr().err
    assert err == "kinfer simulate: IndexError: list index out of range (kinfer --debug simulate ... shows where)\n"
    with pytest.raises(IndexError):
        main(["--debug", "simulate"])


def test_every_option_with_a_default_shows_it_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    def walk(parser: argparse.ArgumentParser, path: str) -> list[str]:
        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    missing += walk(child, f"{path} {name}")
            elif action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
                text = action.help or ""
                if "%(default)" not in text and "default" not in text.lower() and not text.rstrip().endswith("]"):
                    missing.append(f"{path} {action.option_strings[-1]}")
        return missing

    assert walk(build_parser(), "kinfer") == []
    with pytest.raises(SystemExit):
        main(["gateway", "--help"])
    shown = capsys.readouterr().out
    assert re.search(r"--port PORT +\[8000\]", shown) and "[10] [10.0]" not in shown


def test_the_cli_reference_is_what_the_parser_says() -> None:
    """docs/cli.md is rendered from the parser: a flag, default or help changed in code shows there too."""
    written = (Path(kinfer.__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert written == render(), f"docs/cli.md is out of date: regenerate it with `{REGENERATE}`"
