"""Generation through the real broker and Redis: streamed tokens, and cancellation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest

from kinfer.consumers.runners.tinylm import build_tiny_lm
from kinfer.ops.localstack.procs import wait_until_served
from kinfer.producers import Client
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-lm"), eos=False, init=0.2)


@pytest.mark.parametrize("engine", ["dynamic", "slots"])
async def test_stream_matches_the_one_shot_result_and_ends_with_usage(
    client: Client, topics: str, lm_dir: Path, spawn_worker: Callable[..., WorkerProcess], engine: str
) -> None:
    spawn_worker(topics, "--family", "generator", "--path", str(lm_dir), "--option", f"engine={engine}",
                 "--option", "slots=4", "--option", "context=256")
    await wait_until_served(client, topics)
    params = {"max_new_tokens": 12}
    chunks = [c async for c in client.stream(topics, "tell me about kafka", params=params, deadline_ms=30_000)]
    assert [c.seq for c in chunks] == list(range(12))  # one chunk a token, in order
    final = chunks[-1]
    assert final.final and final.finish == "length" and final.completion_tokens == 12 and final.prompt_tokens > 0
    streamed = "".join(c.text for c in chunks)
    one_shot = await client.infer(topics, ["tell me about kafka"], params=params, deadline_ms=30_000)
    assert one_shot.outputs[0]["text"] == streamed  # greedy: the same tokens either way
    assert one_shot.outputs[0]["completion_tokens"] == 12


async def test_a_client_that_walks_away_frees_its_slot(
    client: Client, topics: str, lm_dir: Path, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    worker = spawn_worker(topics, "--family", "generator", "--path", str(lm_dir))
    await wait_until_served(client, topics)
    stream = client.stream(topics, "a long story", params={"max_new_tokens": 2000}, deadline_ms=120_000)
    async with contextlib.aclosing(stream) as chunks:
        async for c in chunks:
            if c.seq == 3:
                break  # leaving the block cancels the generation
    await worker.wait_metric("kinfer_generation_cancelled_total", 1, timeout_s=30)
    await worker.wait_metric("kinfer_results_total", 1, timeout_s=30, status="ok")  # the probe's reply
    # The cancelled sequence left the running batch: nothing is generating any more.
    for _ in range(100):
        if worker.metric("kinfer_generation_running") == 0:
            break
        await asyncio.sleep(0.1)
    assert worker.metric("kinfer_generation_running") == 0
    assert worker.metric("kinfer_generated_tokens_total") < 500
