"""``kinfer bench peers``' parts that need no peer installed: the APIs the generator speaks, what it
counts as answered, the peers' installs kept or made again, and their processes found and stopped."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kinfer.ops.bench import peers
from kinfer.ops.bench.harness import descendants
from kinfer.ops.bench.loadgen import APIS, HttpPool, api_outcome, api_request
from kinfer.ops.cli.bench import KINFER_ENTRIES, PEER_NAMES, PEER_RATES
from kinfer.ops.localstack.procs import stop_process


def _parse(request: bytes) -> tuple[str, str, dict[str, Any]]:
    head, body = request.split(b"\r\n\r\n", 1)
    method, path, _ = head.split(b"\r\n")[0].decode().split(" ")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    assert len(body) == length
    return method, path, json.loads(body)


def test_each_api_asks_for_one_embedding_of_the_text() -> None:
    text = "kafka broker \"quoted\" ünïcode"
    assert _parse(api_request("native", "minilm", text, 700)) == (
        "POST", "/v1/models/minilm/infer", {"inputs": [text], "timeout_ms": 700})
    assert _parse(api_request("openai", "minilm", text, 700)) == (
        "POST", "/embeddings", {"model": "minilm", "input": [text]})
    method, path, body = _parse(api_request("v2", "minilm", text, 700))
    assert (method, path) == ("POST", "/v2/models/minilm/infer")
    assert body == {"inputs": [{"name": "args", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    with pytest.raises(ValueError, match="unknown API"):
        api_request("grpc", "minilm", text, 700)


def test_what_counts_as_answered() -> None:
    assert api_outcome("native", 200, b'{"id":"x","status":"ok","outputs":[]}') == "ok"
    assert api_outcome("native", 200, b'{"id":"x","status":"error"}') == "http_200"  # kinfer's own status
    assert api_outcome("native", 503, b"{}") == "http_503"
    for api in ("openai", "v2"):
        assert api_outcome(api, 200, b"{}") == "ok"
        assert api_outcome(api, 500, b"{}") == "http_500"
        assert api_outcome(api, 429, b"{}") == "http_429"


def test_the_generator_speaks_each_api_to_a_server() -> None:
    """The generator's own HTTP client against a server that answers as a peer would (keep-alive, a
    Content-Length): every API's request reaches the path it names and its answer is read."""
    seen: list[tuple[str, dict[str, Any]]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await answer_each(reader, writer)
        except asyncio.IncompleteReadError:  # the client closed its connection
            pass
        finally:
            writer.close()

    async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            body = json.loads(await reader.readexactly(length))
            path = head.split(b" ")[1].decode()
            seen.append((path, body))
            answer = b'{"status":"ok"}' if path.startswith("/v1/") else b'{"data":[{"embedding":[0.5]}]}'
            status = b"200 OK" if "nope" not in path else b"404 Not Found"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(answer)).encode() + b"\r\n\r\n" + answer)
            await writer.drain()

    async def main() -> list[str]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = HttpPool("127.0.0.1", port, 2)
        try:
            outcomes = []
            for api in [*APIS, *APIS]:
                status, body = await pool.post(api_request(api, "minilm", "a text", 500))
                outcomes.append(api_outcome(api, status, body))
            status, body = await pool.post(api_request("v2", "nope", "a text", 500))
            outcomes.append(api_outcome("v2", status, body))
            return outcomes
        finally:
            pool.close()
            server.close()
            await server.wait_closed()  # once the handlers saw the client's connections close

    outcomes = asyncio.run(main())
    assert outcomes == ["ok"] * 6 + ["http_404"]
    assert [path for path, _ in seen] == ["/v1/models/minilm/infer", "/embeddings", "/v2/models/minilm/infer"] * 2 + [
        "/v2/models/nope/infer"]


def test_the_command_line_names_every_peer_and_the_rates() -> None:
    assert tuple(peers.PEERS) == PEER_NAMES
    assert tuple(peers.KINFER) == KINFER_ENTRIES
    assert tuple(float(r) for r in PEER_RATES.split(",")) == peers.RATES
    assert list(peers.RATES) == sorted(set(peers.RATES))
    for peer in peers.PEERS.values():
        assert peer.api in APIS
        assert all("==" in req for req in peer.requirements), peer.requirements  # the set that runs, pinned


def test_an_install_is_kept_until_its_requirements_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def run(cmd: list[str], check: bool) -> None:
        calls.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            Path(cmd[3], "bin").mkdir(parents=True)

    monkeypatch.setattr(subprocess, "run", run)
    peer = peers.PEERS["mlserver"]
    venv = peers.install(peer, tmp_path)
    assert venv == tmp_path / "mlserver"
    assert [c[1:3] for c in calls] == [["-m", "venv"], ["-m", "pip"]]
    assert calls[1][-len(peer.requirements):] == list(peer.requirements)
    assert peers.install(peer, tmp_path) == venv and len(calls) == 2  # kept
    (venv / "stale").write_text("from the old install")
    changed = peers.Peer(**{**peer.__dict__, "requirements": (*peer.requirements, "extra==1.0")})
    peers.install(changed, tmp_path)
    assert len(calls) == 4 and not (venv / "stale").exists()  # made again, from nothing
    assert (venv / ".kinfer-peer").read_text().endswith("extra==1.0")


def test_mlservers_settings_name_its_port_and_the_model(tmp_path: Path) -> None:
    cmd = peers._mlserver_command(Path("/venv"), Path("/models/minilm"), "minilm", 8123, tmp_path)
    assert cmd == ["/venv/bin/mlserver", "start", str(tmp_path)]
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings["http_port"] == 8123 and settings["host"] == "127.0.0.1"
    assert len({settings["http_port"], settings["grpc_port"], settings["metrics_port"]}) == 3
    model = json.loads((tmp_path / "minilm" / "model-settings.json").read_text())
    assert model["name"] == "minilm" and model["max_batch_size"] == peers.BATCH_SIZE
    assert model["parameters"]["extra"]["pretrained_model"] == "/models/minilm"


def test_a_peers_processes_are_found_and_stopped_together() -> None:
    """A server that forks (MLServer's inference worker): its CPU is charged by every PID under it, and
    stopping it stops the group it leads, children included, and nothing else."""
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not (children := descendants(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(children) == 1
        stop_process(proc, timeout_s=5, group=True)
        assert proc.poll() is not None
        deadline = time.monotonic() + 10
        while Path(f"/proc/{children[0]}").exists() and _state(children[0]) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{children[0]}").exists() or _state(children[0]) == "Z"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_kinfer_is_compared_with_peers_of_its_precision_and_with_all() -> None:
    def system(rps: float, precision: str, kinfer: bool) -> dict[str, Any]:
        return {"max_rps_at_sla": rps, "precision": precision, "kinfer": kinfer}

    systems = {"kinfer": system(40, "fp32", True), "kinfer-int8": system(120, "int8", True),
               "infinity": system(60, "fp32", False), "infinity-int8": system(100, "int8", False),
               "mlserver": system(40, "fp32", False)}
    assert peers.ratios(systems) == {
        "fp32": {"kinfer": "kinfer", "peer": "infinity", "ratio": 0.667},
        "int8": {"kinfer": "kinfer-int8", "peer": "infinity-int8", "ratio": 1.2},
        "any": {"kinfer": "kinfer-int8", "peer": "infinity-int8", "ratio": 1.2},
    }
    del systems["infinity-int8"]
    assert set(peers.ratios(systems)) == {"fp32", "any"}  # no int8 peer ran: no int8 ratio
    systems["infinity"]["max_rps_at_sla"] = 0.0  # a peer that met the SLA at no rate
    assert peers.ratios({"kinfer": systems["kinfer"], "infinity": systems["infinity"]})["fp32"]["ratio"] is None
