"""A blocking face for code without an event loop: the async client on a private loop thread.

    with BlockingClient("127.0.0.1:9092", "redis://127.0.0.1:6379/0") as client:
        vector = client.infer("minilm", ["a sentence"]).outputs[0]
        for chunk in client.stream("tiny-lm", "Once upon a time", params={"max_new_tokens": 16}):
            print(chunk.text, end="")
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from kinfer.producers.client import Client
from kinfer.topics import Chunk, KinferError, Result

T = TypeVar("T")


class BlockingClient:
    def __init__(self, bootstrap: str, redis_url: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kinfer-client", daemon=True)
        self._thread.start()
        async def start() -> Client:  # aiokafka objects must be made on the loop that runs them
            client = Client(bootstrap, redis_url, **options)
            await client.start()
            return client

        try:
            self._client = self._call(start())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, work: Awaitable[T]) -> T:
        async def run() -> T:
            return await work

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def infer(self, model: str, inputs: str | Sequence[str] = (), **options: Any) -> Result:
        return self._call(self._client.infer(model, inputs, **options))

    def infer_many(
        self, model: str, batch: Sequence[str | Sequence[str]], **options: Any
    ) -> list[Result | KinferError]:
        return self._call(self._client.infer_many(model, batch, **options))

    def stream(self, model: str, prompt: str | None = None, **options: Any) -> Iterator[Chunk]:
        chunks = self._client.stream(model, prompt, **options)
        try:
            while True:
                try:
                    yield self._call(chunks.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(chunks.aclose())  # type: ignore[attr-defined]  # a stream left early is cancelled

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self._client.close())
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
