"""The gateway with real clients — httpx, a WebSocket client, the official openai package — against
real workers on the real broker and Redis; and Schemathesis fuzzing its OpenAPI document."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import redis.asyncio as aioredis
import uvicorn
import websockets
from transformers import AutoTokenizer

from kinfer.consumers.runners.registry import minilm_path
from kinfer.consumers.runners.tinylm import build_tiny_classifier, build_tiny_lm
from kinfer.ops.localstack.procs import wait_until_served
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers import Client
from kinfer.producers.gateway import GatewaySettings, create_app
from kinfer.producers.http import MAX_BODY_BYTES, MAX_FRAME_BYTES, guarded_protocol
from kinfer.producers.tenants import Tenants, hash_key
from kinfer.topics import now_ms
from kinfer.topics.admin import ensure_topics, model_topic_specs
from kinfer.topics.health import HEALTH_CHANNEL, HealthState, Level
from tests.integration.conftest import WorkerProcess, delete_model_topics

pytestmark = pytest.mark.integration

KEY, SLOW_KEY = "alpha-key", "slow-key"


class Served:
    def __init__(self, url: str, noop: str, lm: str, emb: str, clf: str) -> None:
        self.url, self.noop, self.lm, self.emb, self.clf = url, noop, lm, emb, clf


# The tiny LM's own chat template: the gateway passes the turns, the worker renders them with this.
OWN_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}<answer>"


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("lm"), eos=False, chat_template=OWN_TEMPLATE)


@pytest.fixture(scope="module")
def workers(stack: StackInfo, lm_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[str, str, str, str]]:
    base = f"gw-{uuid.uuid4().hex[:6]}"
    noop, lm, emb, clf = f"{base}-noop", f"{base}-lm", f"{base}-emb", f"{base}-clf"
    models = (noop, lm, emb, clf)
    asyncio.run(ensure_topics(stack.bootstrap, [s for m in models for s in model_topic_specs(m, 2)]))
    clf_dir = build_tiny_classifier(tmp_path_factory.mktemp("clf"))
    logs = tmp_path_factory.mktemp("gw-logs")
    procs = [
        WorkerProcess(stack, noop, logs, "--family", "noop"),
        WorkerProcess(stack, lm, logs, "--family", "generator", "--path", str(lm_dir)),
        WorkerProcess(stack, emb, logs, "--family", "embedding", "--path", str(minilm_path())),
        WorkerProcess(stack, clf, logs, "--family", "classifier", "--path", str(clf_dir)),
    ]
    yield models
    for p in procs:
        p.stop()
    for model in models:
        asyncio.run(delete_model_topics(stack.bootstrap, model))


@pytest.fixture(scope="module")
async def gateway(stack: StackInfo, workers: tuple[str, str, str, str], tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[Served]:
    async with Client(stack.bootstrap, stack.redis_url) as c:
        for m in workers:
            await wait_until_served(c, m)
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "alpha", "key_sha256": hash_key(KEY), "rate_per_s": 1000, "burst": 1000, "max_priority": 0},
        {"name": "slow", "key_sha256": hash_key(SLOW_KEY), "rate_per_s": 0.2, "burst": 2, "max_priority": 2},
    ]}))
    port = free_port()
    app = create_app(GatewaySettings(stack.bootstrap, stack.redis_url, Tenants.from_file(path)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                          http=guarded_protocol(header_timeout_s=1.0), ws_max_size=MAX_FRAME_BYTES))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, not an event
        await asyncio.sleep(0.05)
    yield Served(f"http://127.0.0.1:{port}", *workers)
    server.should_exit = True
    await task


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_infer_models_and_probes(gateway: Served) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        r = await http.post(f"/v1/models/{gateway.noop}/infer", json={"inputs": ["abc", "hello"]}, headers=auth())
        assert r.status_code == 200, r.text
        assert r.json()["outputs"] == [3, 5] and r.json()["status"] == "ok"
        r = await http.post(f"/v1/models/{gateway.clf}/infer", json={"inputs": ["great", "awful"]}, headers=auth())
        assert r.status_code == 200, r.text
        for out in r.json()["outputs"]:  # classification: the best label, its score, the ranking
            assert out["label"] in {"negative", "neutral", "positive"} and 0 < out["score"] <= 1
            assert out["labels"][0]["label"] == out["label"]
        models = (await http.get("/v1/models", headers=auth())).json()["data"]
        assert {gateway.noop, gateway.lm, gateway.emb} <= {m["id"] for m in models}
        assert (await http.get("/healthz")).status_code == 200
        ready = await http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["kafka"] and ready.json()["redis"]
        assert "kinfer_gateway_requests_total" in (await http.get("/metrics")).text


async def test_errors_map_to_status_codes(gateway: Served) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        assert (await http.post(f"/v1/models/{gateway.noop}/infer", json={"inputs": "x"})).status_code == 401
        r = await http.post(f"/v1/models/{gateway.noop}/infer", json={"inputs": "x"}, headers=auth("nope"))
        assert r.status_code == 401
        r = await http.post("/v1/models/no-such-model/infer", json={"inputs": "x"}, headers=auth())
        assert r.status_code == 404 and r.json()["error"]["field"] == "model"
        r = await http.post(f"/v1/models/{gateway.noop}/infer", json={"inputs": []}, headers=auth())
        assert r.status_code == 400 and r.json()["error"]["field"] == "inputs"
        r = await http.post(f"/v1/models/{gateway.noop}/infer", json={"inputs": "x", "priority": 7}, headers=auth())
        assert r.status_code == 422 and "priority" in r.text
        r = await http.post("/v1/completions", json={"model": gateway.emb, "prompt": "x"}, headers=auth())
        assert r.status_code == 400  # an embedding model cannot complete text
        r = await http.delete("/v1/completions", headers=auth())  # no such method: the same error shape
        assert r.status_code == 405 and r.json()["error"]["type"] == "method_not_allowed"


async def test_the_health_signal_becomes_429_with_retry_after_and_the_degradation_level(
    gateway: Served, stack: StackInfo
) -> None:
    redis = aioredis.Redis.from_url(stack.redis_url)

    async def announce(level: Level) -> None:  # what `kinfer lagmon` publishes
        state = HealthState(gateway.noop, level, 0.0, 3_000, 0, 0.0, 0.0, now_ms())
        await redis.publish(HEALTH_CHANNEL, state.pack())

    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            body = {"inputs": "batch work", "priority": 2}
            for _ in range(100):  # until the gateway's client has the notification
                await announce(Level.SHEDDING)
                r = await http.post(f"/v1/models/{gateway.noop}/infer", json=body, headers=auth())
                if r.status_code == 429:
                    break
                await asyncio.sleep(0.05)
            assert r.status_code == 429, r.text
            assert r.headers["X-Kinfer-Degradation"] == "shedding" and int(r.headers["Retry-After"]) == 3
            assert r.json()["error"]["type"] == "Overloaded"
            urgent = await http.post(f"/v1/models/{gateway.noop}/infer", json={"inputs": "now", "priority": 0},
                                     headers=auth())
            assert urgent.status_code == 200  # shedding refuses p2 only
            metrics = (await http.get("/metrics")).text
            assert f'kinfer_admission_refused_total{{cause="level",model="{gateway.noop}",priority="p2"}}' in metrics
            assert 'kinfer_gateway_errors_total{status="429",type="Overloaded"}' in metrics
    finally:
        await announce(Level.OK)
        await redis.aclose()


async def test_rate_limit_answers_429_with_retry_after(gateway: Served) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        codes = []
        for _ in range(4):
            r = await http.post(f"/v1/models/{gateway.noop}/infer", json={"inputs": "x"}, headers=auth(SLOW_KEY))
            codes.append(r.status_code)
        assert codes[:2] == [200, 200] and codes[2:] == [429, 429]
        assert int(r.headers["Retry-After"]) >= 1


async def test_sse_stream_and_websocket(gateway: Served) -> None:
    body = {"prompt": "tell me a story", "params": {"max_new_tokens": 6}}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http, http.stream(
        "POST", f"/v1/models/{gateway.lm}/stream", json=body, headers=auth()
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"  # no proxy may hold the stream back
        events = [line.removeprefix("data: ") async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["seq"] for c in chunks] == list(range(6)) and chunks[-1]["final"]

    ws_url = gateway.url.replace("http", "ws") + f"/v1/models/{gateway.lm}/ws"
    async with websockets.connect(ws_url, additional_headers=auth()) as ws:
        await ws.send(json.dumps({"id": "w1", "stream": True, **body}))
        got = []
        while not got or not got[-1].get("final"):
            got.append(json.loads(await ws.recv()))
        assert [g["seq"] for g in got] == list(range(6)) and {g["id"] for g in got} == {"w1"}
        await ws.send(json.dumps({"id": "w2", "inputs": "abcd"}))
        reply = json.loads(await ws.recv())
        assert reply["id"] == "w2" and reply["status"] == "ok"
        await ws.send(json.dumps({"id": "w3", "inputs": []}))
        assert json.loads(await ws.recv())["code"] == 400
    streamed = "".join(c["text"] for c in chunks)
    assert streamed == "".join(g["text"] for g in got)  # greedy: the same text both ways


async def test_openai_package_embeddings_and_completions(gateway: Served) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0) as oai:
        emb = await oai.embeddings.create(model=gateway.emb, input=["a cat", "a dog"])
        vectors = np.array([d.embedding for d in emb.data])
        assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
        assert emb.usage.prompt_tokens == 8  # the tokenizer's: [CLS] a cat [SEP], [CLS] a dog [SEP]
        done = await oai.completions.create(model=gateway.lm, prompt="once upon", max_tokens=5, temperature=0)
        assert done.choices[0].finish_reason == "length" and done.usage is not None
        assert done.usage.completion_tokens == 5
        parts = [c.choices[0].text async for c in await oai.completions.create(
            model=gateway.lm, prompt="once upon", max_tokens=5, temperature=0, stream=True)]
        assert "".join(parts) == done.choices[0].text
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="bad", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.embeddings.create(model=gateway.emb, input="x")


async def test_schemathesis_finds_no_server_error(gateway: Served, tmp_path: Path) -> None:
    """Fuzzing every documented operation finds no 5xx but a deadline's own answer (``schemathesis_hooks``)."""
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{gateway.url}/openapi.json",
        "--checks", "no_unnamed_server_error", "--max-examples", "25", "-H", f"Authorization: Bearer {KEY}",
        "--exclude-path-regex", "/metrics", "--request-timeout", "20", "--no-color",
        *(["--seed", os.environ["KINFER_SCHEMATHESIS_SEED"]] if "KINFER_SCHEMATHESIS_SEED" in os.environ else []),
    ]
    env = {**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_HOOKS": "tests.integration.schemathesis_hooks"}
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out, _ = await asyncio.wait_for(proc.communicate(), 240)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]


async def test_hostile_http_input_gets_4xx_never_a_server_error(gateway: Served) -> None:
    url = f"/v1/models/{gateway.noop}/infer"
    headers = {**auth(), "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        cases = {
            b'{"inputs": "\\ud800"}': 422,  # a lone UTF-16 surrogate
            b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}": 422,  # deep nesting
            b"not json": 422,
            b'{"inputs": "x", "unknown": [1, 2, 3]}': 422,
            b"x" * (3 * 1_048_576): 413,  # over the body cap
        }
        for body, status in cases.items():
            r = await http.post(url, content=body, headers=headers)
            assert r.status_code == status, (body[:40], r.text[:200])
            assert r.json()["error"]["type"] == "invalid"
        r = await http.post(url, json={"inputs": "x"}, headers={**auth(), "X-Request-Timeout-Ms": "soon"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "X-Request-Timeout-Ms"
        assert (await http.post(url, json={"inputs": "still served"}, headers=auth())).status_code == 200


async def test_websocket_survives_bad_frames_and_answers_out_of_order(gateway: Served) -> None:
    ws_url = gateway.url.replace("http", "ws")
    async with websockets.connect(f"{ws_url}/v1/models/{gateway.noop}/ws", additional_headers=auth()) as ws:
        for bad in ("not json", "[" * 100_000, json.dumps({"id": "z", "inputs": "x", "extra": {"a": 1}})):
            await ws.send(bad)
            assert json.loads(await ws.recv())["code"] == 422
        await ws.send(json.dumps({"id": "ok", "inputs": "abc"}))
        assert json.loads(await ws.recv())["outputs"] == [3]  # the socket still serves
        await ws.send(b"\x00binary")
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1003
    # A long stream does not hold up a short request sent after it on the same socket.
    async with websockets.connect(f"{ws_url}/v1/models/{gateway.lm}/ws", additional_headers=auth()) as ws:
        await ws.send(json.dumps({"id": "long", "stream": True, "prompt": "go", "params": {"max_new_tokens": 256}}))
        await ws.send(json.dumps({"id": "short", "inputs": "go", "params": {"max_new_tokens": 1}}))
        finished = []
        while "long" not in finished:
            message = json.loads(await ws.recv())
            if message.get("final") or message["id"] == "short":
                finished.append(message["id"])
        assert finished == ["short", "long"]  # the short one was not queued behind the long one


async def test_connections_that_never_finish_their_headers_are_closed(gateway: Served) -> None:
    host, port = gateway.url.removeprefix("http://").split(":")
    silent = [await asyncio.open_connection(host, int(port)) for _ in range(20)]
    trickle_reader, trickle = await asyncio.open_connection(host, int(port))
    trickle.write(b"POST /v1/models/x/infer HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    for reader, _ in [*silent, (trickle_reader, trickle)]:
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by the server, not by us
    for _, writer in [*silent, (trickle_reader, trickle)]:
        writer.close()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:  # a served request is not cut
        assert (await http.get("/healthz")).status_code == 200


async def test_openai_package_chat_completions(gateway: Served, lm_dir: Path) -> None:
    messages: list[Any] = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "once upon"}]
    # The model's own template, as the worker renders it (developer is OpenAI's name for system).
    rendered = "<system> be brief <user> once upon <answer>"
    tokenizer = AutoTokenizer.from_pretrained(str(lm_dir))
    assert tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "once upon"}],
        tokenize=False, add_generation_prompt=True) == rendered
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0) as oai:
        done = await oai.chat.completions.create(model=gateway.lm, messages=messages, max_tokens=5, temperature=0)
        choice = done.choices[0]
        assert done.object == "chat.completion" and choice.message.role == "assistant"
        assert isinstance(choice.message.content, str) and done.usage is not None
        assert done.usage.completion_tokens <= 5
        assert done.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        stream = await oai.chat.completions.create(model=gateway.lm, messages=messages, max_tokens=5, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert chunks[-1].choices == [] and chunks[-1].usage == done.usage
        for options in ({"n": 2}, {"logprobs": True}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
                        {"response_format": {"type": "json_object"}}):
            with pytest.raises(openai.BadRequestError) as refused:
                await oai.chat.completions.create(model=gateway.lm, messages=messages, **options)  # type: ignore[call-overload]
            assert refused.value.param == next(iter(options))
        with pytest.raises(openai.BadRequestError) as refused:  # an embedding model does not chat
            await oai.chat.completions.create(model=gateway.emb, messages=messages)
        assert refused.value.param == "model"
        with pytest.raises(openai.BadRequestError) as refused:  # OpenAI's 400 for a body off the schema
            await oai.chat.completions.create(model=gateway.lm, messages=[])
        assert refused.value.param == "messages"


async def test_openai_package_retrieve_usage_in_streams_and_unsupported_options(gateway: Served) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0) as oai:
        assert (await oai.models.retrieve(gateway.lm)).id == gateway.lm
        with pytest.raises(openai.NotFoundError):
            await oai.models.retrieve("no-such-model")
        chunks = [c async for c in await oai.completions.create(
            model=gateway.lm, prompt="once upon", max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 4
        assert all(c.usage is None for c in chunks[:-1])
        # Options kinfer does not implement are refused, by name, never silently ignored.
        for options in ({"n": 2}, {"logprobs": 1}, {"echo": True}, {"frequency_penalty": 0.5}):
            with pytest.raises(openai.BadRequestError) as refused:
                await oai.completions.create(model=gateway.lm, prompt="x", max_tokens=2, **options)  # type: ignore[call-overload]
            assert refused.value.param == next(iter(options))
        with pytest.raises(openai.BadRequestError):
            await oai.embeddings.create(model=gateway.emb, input="x", dimensions=64)
        # Input shapes OpenAI takes and kinfer does not: named, with what to send instead.
        with pytest.raises(openai.BadRequestError, match="a list of prompts") as refused:
            await oai.completions.create(model=gateway.lm, prompt=["a", "b"], max_tokens=2)
        assert refused.value.param == "prompt"
        with pytest.raises(openai.BadRequestError, match="token ids are not supported") as refused:
            await oai.embeddings.create(model=gateway.emb, input=[[101, 2023, 102]])
        assert refused.value.param == "input"
        with pytest.raises(openai.NotFoundError) as missing:  # a route kinfer does not serve
            await oai.responses.create(model=gateway.lm, input="hi")
        assert missing.value.body == {"type": "not_found", "message": "POST /v1/responses: Not Found",
                                      "param": None, "code": None}


DEEP = b"[" * 100_000 + b"]" * 100_000


async def test_hostile_bodies_and_headers_get_4xx_naming_what_is_wrong_and_the_gateway_serves_on(
    gateway: Served,
) -> None:
    chat = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2' % gateway.lm.encode()
    completion = b'{"model": "%s", "prompt": "hi", "max_tokens": 2' % gateway.lm.encode()
    native = f"/v1/models/{gateway.lm}/stream"
    # (route, body, status, the param the error names; None: no single field is to blame)
    cases: list[tuple[str, bytes, int, str | None]] = [
        ("/v1/chat/completions", chat + b', "metadata": ' + DEEP + b"}", 400, "body"),  # unknown field, deep
        ("/v1/chat/completions", chat + b', "tools": [{"type": "function", "function": {"name": "f", '
         b'"parameters": ' + DEEP + b"}}]}", 400, "body"),
        ("/v1/chat/completions", chat + b', "response_format": ' + DEEP + b"}", 400, "response_format"),  # typed
        ("/v1/chat/completions", chat + b', "response_format": {"type": "json_schema", "json_schema": ' + DEEP
         + b"}}", 400, "body"),
        ("/v1/chat/completions", chat + b', "temperature": 1e-40}', 400, "temperature"),
        ("/v1/chat/completions", chat + b', "top_p": 1e-300}', 400, "top_p"),
        ("/v1/chat/completions", chat + b', "temperature": NaN}', 400, "body"),
        ("/v1/chat/completions", chat + b', "temperature": "nan"}', 400, "temperature"),
        ("/v1/chat/completions", chat + b', "temperature": 1e999}', 400, "temperature"),
        ("/v1/chat/completions", chat + b', "seed": 1e999}', 400, "seed"),
        ("/v1/chat/completions", chat + b', "max_tokens": 18446744073709551616}', 400, "max_tokens"),
        ("/v1/chat/completions", chat + b', "stop": ["a", "b", "c", "d", "e"]}', 400, "stop"),
        ("/v1/chat/completions", chat + b', "user": "' + b"u" * 300 + b'"}', 400, "user"),
        ("/v1/completions", completion + b', "logit_bias": {' + b",".join(b'"%d": 1' % i for i in range(1_100))
         + b"}}", 400, "logit_bias"),
        ("/v1/completions", completion + b', "top_p": 0}', 400, "top_p"),
        ("/v1/embeddings", b'{"model": "%s", "input": [' % gateway.emb.encode() + b'"a",' * 300 + b'"a"]}', 400,
         "input"),
        ("/v1/embeddings", b"\xff\xfe" + DEEP, 400, "body"),
        (native, b'{"prompt": "x", "params": {"temperature": 1e-40}}', 400, "params"),  # refused by the worker
        (native, b'{"prompt": "x", "params": {"temperature": "nan"}}', 400, "params"),
        (native, b'{"prompt": "x", "params": {"top_p": 1e-300, "temperature": 1.0}}', 400, "params"),
        (native, b'{"prompt": "x", "params": {"max_new_tokens": 1e300}}', 400, "params"),
        (native, b'{"prompt": "x", "params": {"seed": 1e300, "temperature": 0.5}}', 400, "params"),
        (native, b'{"prompt": "x", "params": {"stop": "' + b"s" * 2_000 + b'"}}', 422, "params"),
        (native, b'{"prompt": "x", "params": {"k": ' + DEEP + b"}}", 422, "params"),
        (f"/v1/models/{gateway.noop}/infer", b'{"inputs": [' + b'"a",' * 400_000 + b'"a"]}', 422, "inputs"),
        (f"/v1/models/{gateway.noop}/infer", b"[" * (MAX_BODY_BYTES + 1), 413, None),
    ]
    headers = {**auth(), "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        for route, body, status, field in cases:
            r = await http.post(route, content=body, headers=headers)
            assert r.status_code == status, (route, body[:80], r.text[:300])
            error = r.json()["error"]  # OpenAI's error shape on every route
            assert error["message"] and error["param"] == field, (route, body[:80], error)
        for value in ("²", "¹²³²", "1" * 5_000, "-5000", "5000.0", "1_000", "5e3", "999", "600001"):
            for route, body in ((f"/v1/models/{gateway.noop}/infer", b'{"inputs": "x"}'),
                                ("/v1/completions", completion + b"}")):
                # As the bytes arrive: Starlette reads header values as Latin-1, so b"\xb2" is "²".
                raw = {"X-Request-Timeout-Ms": value.encode("latin-1")}
                r = await http.post(route, content=body, headers={**headers, **raw})
                assert r.status_code == 422, (value, r.text[:200])
                assert r.json()["error"]["param"] == "X-Request-Timeout-Ms"
        # Still served, by the gateway and by the workers behind it.
        r = await http.post("/v1/chat/completions", content=chat + b', "temperature": 0.0001, "top_p": 0.000001}',
                            headers=headers)
        assert r.status_code == 200, r.text
        r = await http.post("/v1/completions", headers=headers, content=completion
                            + b', "metadata": {"tags": [1, 2, {"a": null}]}, "store": false, "top_p": 1e-6}')
        assert r.status_code == 200, r.text
        r = await http.post(native, json={"prompt": "x", "params": {"max_new_tokens": 3, "temperature": 100.0}},
                            headers=auth())
        assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]"), r.text
        r = await http.post(f"/v1/models/{gateway.noop}/infer", json={"inputs": "still served"},
                            headers={**auth(), "X-Request-Timeout-Ms": "5000"})
        assert r.status_code == 200, r.text
        assert 'kinfer_gateway_errors_total{status="500"' not in (await http.get("/metrics")).text


async def test_openai_package_tiny_sampling_parameters_are_refused_by_name(gateway: Served) -> None:
    messages: list[Any] = [{"role": "user", "content": "once upon"}]
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0) as oai:
        for options in ({"temperature": 1e-40}, {"top_p": 1e-300}, {"temperature": 1e-40, "top_p": 1e-300}):
            with pytest.raises(openai.BadRequestError) as refused:
                await oai.chat.completions.create(model=gateway.lm, messages=messages, max_tokens=2, **options)
            assert refused.value.param in options
            with pytest.raises(openai.BadRequestError):
                await oai.completions.create(model=gateway.lm, prompt="x", max_tokens=2, **options)
        done = await oai.chat.completions.create(model=gateway.lm, messages=messages, max_tokens=2, temperature=2,
                                                 top_p=1e-6, seed=2**62)
        assert done.usage is not None and done.usage.completion_tokens == 2


async def test_hostile_websocket_frames_are_refused_and_the_socket_or_the_next_one_serves(gateway: Served) -> None:
    url = gateway.url.replace("http", "ws") + f"/v1/models/{gateway.noop}/ws"
    async with websockets.connect(url, additional_headers=auth(), max_size=None) as ws:
        frames = {
            json.dumps({"id": "wide", "inputs": ["a"] * 300_000}): ("inputs", 422),  # 1.5 MB of one-letter inputs
            json.dumps({"id": "many", "inputs": ["a"] * 257}): ("inputs", 422),
            json.dumps({"id": "long", "inputs": "a" * 16_385}): ("inputs", 422),
            json.dumps({"id": "p", "inputs": "a", "params": {"k": "v" * 1_025}}): ("params", 422),
            '{"id": "deep", "inputs": "x", "params": {"k": ' + "[" * 100_000 + "]" * 100_000 + "}}": ("params", 422),
            '{"id": 18446744073709551616, "inputs": "x"}': ("id", 422),
            '{"id": "nan", "inputs": "x", "params": {"t": NaN}}': (None, 422),
            '{"id": "u", "inputs": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}": (None, 422),
        }
        for frame, (field, code) in frames.items():
            assert len(frame) <= MAX_FRAME_BYTES
            await ws.send(frame)
            reply = json.loads(await ws.recv())
            assert reply["code"] == code and reply["error"]["param"] == field, (frame[:60], reply)
        await ws.send(json.dumps({"id": "ok", "inputs": "abc"}))
        assert json.loads(await ws.recv())["outputs"] == [3]
        await ws.send(json.dumps({"id": "huge", "inputs": ["a" * 16_000] * 256}))  # ~4 MB: over the frame limit
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # message too big
    async with websockets.connect(url, additional_headers=auth()) as ws:
        await ws.send(json.dumps({"id": "after", "inputs": "abcd"}))
        assert json.loads(await ws.recv())["outputs"] == [4]
