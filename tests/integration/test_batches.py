"""OpenAI's Batch API on the live stack, driven by the official ``openai`` package against ``kinfer
gateway`` processes: a batch survives the gateway that took it being killed mid-batch, two gateways
running at once serve the same files and batches (either may cancel one), and tenants see only their
own files and batches.

The worker is paused while the batch is published, so the gateway is killed (SIGKILL) with every
request waiting; another gateway, started after, finds the batch in Kafka, collects its results from
the start of its reply topic, and writes the output file. Assertions are by counts and ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from kinfer.consumers.runners.registry import minilm_path
from kinfer.ops.localstack.procs import spawn, stop_process, wait_until_served
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers import Client
from kinfer.producers.tenants import hash_key
from kinfer.topics.batches import FILES_TOPIC
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration

KEY, OTHER_KEY = "batch-key-" + os.urandom(8).hex(), "other-key-" + os.urandom(8).hex()
SLOW_KEY = "slow-key-" + os.urandom(8).hex()
LINES = 120


def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "batcher", "key_sha256": hash_key(KEY), "rate_per_s": 100, "burst": 100, "max_priority": 1},
        {"name": "other", "key_sha256": hash_key(OTHER_KEY), "rate_per_s": 100, "burst": 100, "max_priority": 1},
        {"name": "slow", "key_sha256": hash_key(SLOW_KEY), "rate_per_s": 1, "burst": 3, "max_priority": 1},
    ]}))
    return path


def start_gateway(stack: StackInfo, tenants: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    return spawn(stack, "gateway", "--port", str(port), "--tenants", str(tenants), log_path=str(log)), \
        f"http://127.0.0.1:{port}/v1"


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


async def until_up(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0) as oai:
        for _ in range(300):
            assert proc.poll() is None, tail(log)
            try:
                await oai.batches.list()
                return
            except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
                await asyncio.sleep(0.2)
    pytest.fail(f"the gateway never served the Batch API:\n{tail(log)}")


async def status_of(url: str, batch_id: str, wanted: set[str], rounds: int = 600) -> openai.types.Batch:
    async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=2) as oai:
        for _ in range(rounds):
            batch = await oai.batches.retrieve(batch_id)
            if batch.status in wanted:
                return batch
            await asyncio.sleep(0.2)
    raise AssertionError(f"{batch_id} never reached {wanted}: {batch}")


async def test_a_batch_outlives_its_gateway_and_every_line_is_answered_once(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    worker = spawn_worker(topics, "--family", "embedding", "--path", str(minilm_path()))
    async with Client(stack.bootstrap, stack.redis_url) as c:
        await wait_until_served(c, topics)
    tenants = tenants_file(tmp_path)
    first, url = start_gateway(stack, tenants, tmp_path / "gateway-1.log")
    second = None
    try:
        await until_up(url, first, tmp_path / "gateway-1.log")
        lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": topics, "input": f"sentence number {i}"}} for i in range(LINES)]
        data = "\n".join(json.dumps(line) for line in lines).encode()
        async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0) as oai:
            uploaded = await oai.files.create(file=("input.jsonl", data), purpose="batch")
            assert uploaded.bytes == len(data) and uploaded.purpose == "batch"
            os.kill(worker.proc.pid, signal.SIGSTOP)  # every request waits: the gateway dies mid-batch
            try:
                batch = await oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                                 completion_window="24h")
                assert batch.status == "validating" and batch.endpoint == "/v1/embeddings"
                running = await status_of(url, batch.id, {"in_progress"})
                assert running.request_counts is not None and running.request_counts.total == LINES
                first.kill()  # SIGKILL: no goodbye to the runner group
                first.wait()
            finally:
                os.kill(worker.proc.pid, signal.SIGCONT)
        second, url = start_gateway(stack, tenants, tmp_path / "gateway-2.log")
        await until_up(url, second, tmp_path / "gateway-2.log")
        done = await status_of(url, batch.id, {"completed", "failed", "expired", "cancelled"})
        assert done.status == "completed", done
        assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) \
            == (LINES, 0)
        assert done.output_file_id and done.error_file_id is None
        async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0) as oai:
            output = (await oai.files.content(done.output_file_id)).content
            answers = [json.loads(line) for line in output.splitlines()]
            assert sorted(a["custom_id"] for a in answers) == sorted(line["custom_id"] for line in lines)
            for answer in answers:
                response = answer["response"]
                assert response["status_code"] == 200 and answer["error"] is None
                assert len(response["body"]["data"][0]["embedding"]) == 384
            listed = await oai.batches.list()
            assert batch.id in [b.id for b in listed.data]
        async with openai.AsyncOpenAI(base_url=url, api_key=OTHER_KEY, max_retries=0) as other:
            with pytest.raises(openai.NotFoundError):  # another tenant's batch does not exist for it
                await other.batches.retrieve(batch.id)
            with pytest.raises(openai.NotFoundError):
                await other.files.content(done.output_file_id)
            assert batch.id not in [b.id for b in (await other.batches.list()).data]
            with pytest.raises(openai.BadRequestError):  # nor may it start one on another's file
                await other.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                           completion_window="24h")
    finally:
        for proc in (first, second):
            if proc is not None:
                stop_process(proc)


async def test_a_file_with_a_bad_line_fails_its_batch_naming_the_line(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    spawn_worker(topics, "--family", "noop")
    gateway, url = start_gateway(stack, tenants_file(tmp_path), tmp_path / "gateway.log")
    try:
        await until_up(url, gateway, tmp_path / "gateway.log")
        good = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": topics, "input": "x"}}
        lines = [good, {**good, "custom_id": "b", "url": "/v1/completions"}, {**good, "custom_id": "a"},
                 {**good, "custom_id": "c", "body": {"model": topics, "input": 7}}]
        data = "\n".join(json.dumps(line) for line in lines).encode() + b"\n{not json\n"
        async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0) as oai:
            uploaded = await oai.files.create(file=("input.jsonl", data), purpose="batch")
            batch = await oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                             completion_window="24h")
            failed = await status_of(url, batch.id, {"failed", "completed"})
            assert failed.status == "failed" and failed.errors is not None
            assert sorted(e.line for e in failed.errors.data if e.line) == [2, 3, 4, 5], failed.errors
            with pytest.raises(openai.BadRequestError):
                await oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/moderations",
                                         completion_window="24h")
            with pytest.raises(openai.BadRequestError):
                await oai.files.create(file=("input.jsonl", data), purpose="fine-tune")
        # Hostile uploads: each a 4xx naming what is wrong, and the gateway serves on.
        boundary = "b0undary"
        form = f"multipart/form-data; boundary={boundary}"
        part = f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        hostile = [
            ("application/json", b'{"purpose": "batch"}'),  # not a form
            ("multipart/form-data", b"--x\r\n"),  # no boundary
            (form, part.encode()),  # cut off: no closing boundary, no file
            (form, (part + f"--{boundary}--\r\n").encode()),  # no file
            (form, b"\x00" * 10_000),  # not a form at all
            (form, (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
                    + "[" * 100_000 + f"\r\n--{boundary}--\r\n").encode()),  # no purpose; deep nesting inside
        ]
        async with httpx.AsyncClient(base_url=url.removesuffix("/v1"), timeout=30,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            for content_type, body in hostile:
                r = await http.post("/v1/files", content=body, headers={"Content-Type": content_type})
                assert 400 <= r.status_code < 500 and r.json()["error"]["message"], (content_type, body[:60], r.text)
            r = await http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
            assert r.status_code == 200, r.text
    finally:
        stop_process(gateway)


async def test_two_gateways_serve_one_batch_and_either_may_cancel_it(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    # Every request waits (the worker is paused), so the batch is in progress when it is cancelled.
    worker = spawn_worker(topics, "--family", "noop")
    async with Client(stack.bootstrap, stack.redis_url) as c:
        await wait_until_served(c, topics)
    tenants = tenants_file(tmp_path)
    gateways = [start_gateway(stack, tenants, tmp_path / f"gateway-{i}.log") for i in range(2)]
    (_, url_one), (_, url_two) = gateways
    try:
        for i, (proc, url) in enumerate(gateways):
            await until_up(url, proc, tmp_path / f"gateway-{i}.log")
        lines = [{"custom_id": f"c-{i}", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": topics, "input": f"line {i}"}} for i in range(40)]
        data = "\n".join(json.dumps(line) for line in lines).encode()
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            async with openai.AsyncOpenAI(base_url=url_one, api_key=KEY, max_retries=0) as oai:
                uploaded = await oai.files.create(file=("input.jsonl", data), purpose="batch")
                batch = await oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                                 completion_window="24h")
            # The other gateway knows the file and the batch, and cancels it.
            running = await status_of(url_two, batch.id, {"in_progress"})
            assert running.input_file_id == uploaded.id and running.request_counts is not None \
                and running.request_counts.total == len(lines)
            async with openai.AsyncOpenAI(base_url=url_two, api_key=KEY, max_retries=0) as oai:
                assert (await oai.files.retrieve(uploaded.id)).bytes == len(data)
                cancelling = await oai.batches.cancel(batch.id)
                assert cancelling.status in ("cancelling", "cancelled")
            done = await status_of(url_one, batch.id, {"cancelled", "completed", "failed", "expired"})
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        assert done.status == "cancelled" and done.cancelled_at is not None, done
        assert done.request_counts is not None and done.request_counts.total == len(lines)
        assert done.request_counts.completed < len(lines)  # nothing was answered while the worker slept
        async with openai.AsyncOpenAI(base_url=url_one, api_key=KEY, max_retries=0) as oai:
            with pytest.raises(openai.ConflictError):  # a cancelled batch stays cancelled
                await oai.batches.cancel(batch.id)
            assert [b.status for b in (await oai.batches.list()).data if b.id == batch.id] == ["cancelled"]
    finally:
        for proc, _ in gateways:
            stop_process(proc)


async def test_a_small_batch_is_not_held_behind_another_tenants_big_one(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """One tenant's 10,000 lines are queued (a worker that does 160 lines/s would take a minute); another
    tenant's 2-line batch ends while the worker does a few hundred of them at most, not all of them
    (the lines go out a window of about a second at a time, by tenant in turn). Cancelled, the big batch's
    unpublished lines are never computed."""
    worker = spawn_worker(topics, "--family", "noop", "--option", "compute_ms=50", "--max-batch-size", "8")
    async with Client(stack.bootstrap, stack.redis_url) as c:
        await wait_until_served(c, topics)
    proc, url = start_gateway(stack, tenants_file(tmp_path), tmp_path / "gateway.log")

    def computed() -> float:
        return worker.metric("kinfer_results_total", model=topics)

    def batch_file(n: int) -> bytes:
        return "\n".join(json.dumps({"custom_id": f"l-{i}", "method": "POST", "url": "/v1/embeddings",
                                      "body": {"model": topics, "input": f"line {i}"}}) for i in range(n)).encode()
    try:
        await until_up(url, proc, tmp_path / "gateway.log")
        async with openai.AsyncOpenAI(base_url=url, api_key=OTHER_KEY, max_retries=0) as other, \
                openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0) as mine:
            big_file = await other.files.create(file=("big.jsonl", batch_file(10_000)), purpose="batch")
            big = await other.batches.create(input_file_id=big_file.id, endpoint="/v1/embeddings",
                                             completion_window="24h")
            for _ in range(600):
                if await asyncio.to_thread(computed) >= 100:  # the big batch is flowing
                    break
                await asyncio.sleep(0.1)
            small_file = await mine.files.create(file=("small.jsonl", batch_file(2)), purpose="batch")
            before = await asyncio.to_thread(computed)
            small = await mine.batches.create(input_file_id=small_file.id, endpoint="/v1/embeddings",
                                              completion_window="24h")
            done = await status_of(url, small.id, {"completed", "failed", "expired", "cancelled"})
            meanwhile = await asyncio.to_thread(computed) - before
            counts = done.request_counts
            assert done.status == "completed" and counts is not None and counts.completed + counts.failed == 2, done
            assert meanwhile < 2_000, meanwhile  # without turns: all 9,900 lines ahead of it

            assert (await other.batches.cancel(big.id)).status in ("cancelling", "cancelled")
            for _ in range(600):
                ended = await other.batches.retrieve(big.id)
                if ended.status == "cancelled":
                    break
                await asyncio.sleep(0.2)
            assert ended.status == "cancelled", ended
            settled = await asyncio.to_thread(computed)
            for _ in range(30):  # what was in flight at the cancel, and nothing after it
                await asyncio.sleep(0.2)
                now = await asyncio.to_thread(computed)
                if now == settled:
                    break
                settled = now
            assert settled < 5_000, settled  # far from the 10,000: the rest were never published
            log = (tmp_path / "gateway.log").read_text()
            assert f"batch {big.id}: " in log and "lines withdrawn before they were published" in log
    finally:
        stop_process(proc)


def multipart(filename: bytes, data: bytes) -> tuple[bytes, str]:
    """A batch upload form with ``filename`` as raw bytes, and its Content-Type (``charset=utf-7``: the
    gateway decodes the names of the form with it)."""
    body = (b"--B\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + filename + b"\"\r\n"
            b"Content-Type: application/jsonl\r\n\r\n" + data + b"\r\n--B--\r\n")
    return body, "multipart/form-data; boundary=B; charset=utf-7"


def gateway_errors(base: str) -> dict[tuple[str, str], float]:
    text = httpx.get(base.removesuffix("/v1") + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kinfer_gateway_errors_total":
                out[sample.labels["status"], sample.labels["type"]] = sample.value
    return out


async def test_the_files_api_answers_a_hostile_caller_without_telling_it_anything(
    stack: StackInfo, tmp_path: Path
) -> None:
    """No key: the same 401 for an id that exists and one that does not. Every route takes from the
    caller's rate. A filename that decodes to a lone surrogate is stored cleaned. Files are listed a page
    at a time. Headers over their bound are refused before their end. A caller that hangs up mid-upload
    is not a server error."""
    proc, url = start_gateway(stack, tenants_file(tmp_path), tmp_path / "gateway.log")
    try:
        await until_up(url, proc, tmp_path / "gateway.log")
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            mine = {"Authorization": f"Bearer {KEY}"}
            body, kind = multipart(b"+2AA-in.jsonl", b'{"x": 1}')  # utf-7 for a lone surrogate, then "in.jsonl"
            uploaded = await http.post("/files", content=body, headers={**mine, "Content-Type": kind})
            assert uploaded.status_code == 200, uploaded.text
            file_id = uploaded.json()["id"]
            assert uploaded.json()["filename"] == "?in.jsonl"

            unknown = "file-" + "0" * 24
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"}):
                answers = [await http.get(path, headers=headers) for path in (
                    f"/files/{file_id}", f"/files/{unknown}", f"/files/{file_id}/content", f"/files/{unknown}/content",
                    f"/batches/batch_{'0' * 24}", "/files", "/batches")]
                assert {(a.status_code, a.text) for a in answers} == {(401, answers[0].text)}

            slow = {"Authorization": f"Bearer {SLOW_KEY}"}
            statuses = [(await http.get(f"/files/{unknown}", headers=slow)).status_code for _ in range(10)]
            assert statuses[:3] == [404] * 3 and 429 in statuses  # lookups spend the rate like uploads

            mine_ids = {file_id}
            for i in range(3):
                body, kind = multipart(f"page-{i}.jsonl".encode(), b'{"x": 1}')
                page_file = await http.post("/files", content=body, headers={**mine, "Content-Type": kind})
                mine_ids.add(page_file.json()["id"])
            listed: list[str] = []  # the tenant's other tests' files too: the stack is the module's
            params: dict[str, str | int] = {"limit": 2}
            for _ in range(100):
                page = (await http.get("/files", params=params, headers=mine)).json()
                assert len(page["data"]) <= 2
                listed += [f["id"] for f in page["data"]]
                if not page["has_more"]:
                    break
                params = {"limit": 2, "after": page["last_id"]}
            assert len(listed) == len(set(listed)) and mine_ids <= set(listed) and not page["has_more"]

        host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))  # a header of 1 MiB that never ends
        writer.write(b"GET /v1/files HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_048_576)
        answer = b""
        with contextlib.suppress(ConnectionError):  # the gateway may close before it has read what was sent
            await writer.drain()
            answer = await reader.read()
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        writer.close()
        assert (await asyncio.to_thread(gateway_errors, url)).get(("431", "HeadersTooLarge")) == 1

        _, writer = await asyncio.open_connection(host, int(port))
        body, kind = multipart(b"gone.jsonl", b"x" * 100_000)
        writer.write(f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:5_000])
        await writer.drain()
        writer.close()  # hung up mid-body
        for _ in range(100):
            errors = await asyncio.to_thread(gateway_errors, url)
            if errors.get(("499", "ClientDisconnect")):
                break
            await asyncio.sleep(0.1)
        assert errors.get(("499", "ClientDisconnect")) == 1 and not any(s == "500" for s, _ in errors), errors
        assert "unexpected error" not in (tmp_path / "gateway.log").read_text()
    finally:
        stop_process(proc)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def files_topic(bootstrap: str) -> list[tuple[str, bool]]:
    """``kinfer.files`` as written: each record's key, and whether it is a tombstone."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tp = TopicPartition(FILES_TOPIC, 0)
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        out: list[tuple[str, bool]] = []
        while await consumer.position(tp) < end:
            for records in (await consumer.getmany(timeout_ms=1_000)).values():
                out += [(r.key.decode(), r.value is None) for r in records if r.key is not None]
        return out
    finally:
        await consumer.stop()


async def test_stalled_uploads_and_unread_downloads_hold_a_chunk_each(stack: StackInfo, tmp_path: Path) -> None:
    """Four uploads that send 16 MiB of a declared 60 MiB and stop, and four downloads of a 24 MiB file
    that are never read, grow the gateway by a few chunks each, not by what they carry: an upload goes
    to Kafka a chunk at a time as it comes, a download comes from it a chunk at a time as it is read.
    A fifth transfer of a tenant is refused (429). The stalled uploads are given up (408) and their
    chunks tombstoned: no file ever appears for them. Deleting a file removes it."""
    proc, url = start_gateway(stack, tenants_file(tmp_path), tmp_path / "gateway.log")
    uploads: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    downloads: list[asyncio.StreamWriter] = []
    try:
        await until_up(url, proc, tmp_path / "gateway.log")
        size = 24 * 1_048_576
        async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0) as oai:
            uploaded = await oai.files.create(file=("big.jsonl", b"x" * size), purpose="batch")
        host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
        before = rss_kib(proc.pid)
        request = (f"GET /v1/files/{uploaded.id}/content HTTP/1.1\r\nHost: x\r\n"
                   f"Authorization: Bearer {KEY}\r\n\r\n").encode()
        for _ in range(4):  # asked for, and never read
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            await writer.drain()
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            downloads.append(writer)
        head, kind = multipart(b"stalled.jsonl", b"")
        head = head[:head.index(b"\r\n--B--")]  # the form up to the file's first byte
        sent = 16 * 1_048_576
        for _ in range(4):  # another tenant's: 16 MiB of a declared 60 MiB, then nothing
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OTHER_KEY}\r\n"
                         f"Content-Type: {kind}\r\nContent-Length: {60 * 1_048_576}\r\n\r\n".encode() + head)
            for _ in range(sent // 65_536):
                writer.write(b"y" * 65_536)
                await writer.drain()
            uploads.append((reader, writer))
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            mine = {"Authorization": f"Bearer {KEY}"}
            fifth = await http.get(f"/files/{uploaded.id}/content", headers=mine)
            assert fifth.status_code == 429, fifth.text
            # Held whole, they would be 8 × 16 MiB at least; streamed, a few chunks of 0.5 MiB each (the
            # least of a few readings: a chunk's buffers are given back a moment after it is sent).
            grown = []
            for _ in range(5):
                grown.append((rss_kib(proc.pid) - before) / 1024)
                await asyncio.sleep(0.1)
            assert min(grown) < 24, grown
            for reader, _ in uploads:  # each is given up: nothing for 10 s
                answer = await asyncio.wait_for(reader.read(4096), 30)
                assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            for writer in downloads:
                writer.close()
            downloads = []
            for _ in range(100):  # their transfers end as the gateway finds the connections gone
                whole = await http.get(f"/files/{uploaded.id}/content", headers=mine)
                if whole.status_code == 200:
                    break
                await asyncio.sleep(0.1)
            assert whole.status_code == 200 and len(whole.content) == size
            records = await files_topic(stack.bootstrap)
            files = {key[2:] for key, gone in records if key.startswith("f:") and not gone}
            live: dict[str, int] = {}
            for key, gone in records:  # chunks of files without a record: each tombstoned after it came
                if key.startswith("c:") and key[2:].rpartition(":")[0] not in files:
                    live[key] = live.get(key, 0) + (-1 if gone else 1)
            written = [k for k, n in live.items() if n > 0]
            assert len(live) >= 4 * 31 and written == [], written[:5]  # 31 or 32 chunks each, all tombstoned
            deleted = await http.delete(f"/files/{uploaded.id}", headers=mine)
            assert deleted.json() == {"id": uploaded.id, "object": "file", "deleted": True}
            assert (await http.get(f"/files/{uploaded.id}", headers=mine)).status_code == 404
    finally:
        for writer in [*downloads, *(w for _, w in uploads)]:
            writer.close()
        stop_process(proc)
