"""Common mistakes end in one line that says what to do, exit code 2, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from kinfer.ops.cli import main


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
