"""OpenAI's Files and Batch API on the gateway, over ``producers.batches`` (the state lives in Kafka).

    POST /v1/files                      upload a batch input file (multipart: ``purpose=batch``, ``file``)
    GET  /v1/files, /v1/files/{id}      the caller's files
    GET  /v1/files/{id}/content         a file's bytes: an input, or a batch's output or error file (streamed)
    DELETE /v1/files/{id}               remove a file (its bytes leave the compacted topic)
    POST /v1/batches                    start a batch: ``input_file_id``, ``endpoint``, ``completion_window``
    GET  /v1/batches, /v1/batches/{id}  the caller's batches, newest first (``limit``, ``after``)
    POST /v1/batches/{id}/cancel        stop it: what has been answered is its output

Every route authenticates the caller and takes from its rate before it looks anything up or reads a
body: without a valid key the answer is the same 401 whatever the id. A tenant sees and touches only its
own files and batches (another's id is 404, as an unknown one). Every request is bounded before it is read,
and each tenant within its storage (``MAX_TENANT_FILES``, ``MAX_TENANT_BYTES``) and its open transfers
(``MAX_TENANT_TRANSFERS`` uploads and downloads at once): past them, 429.
"""

from __future__ import annotations

import contextlib
import os
import time
import unicodedata
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Annotated, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kinfer.producers.batches import BatchStore, FileTooLarge, new_id
from kinfer.producers.forms import FormRefused, StreamedForm
from kinfer.producers.gateway_pipeline import Gateway, RateLimited
from kinfer.producers.http import BadBody, ascii_int, body_pieces, error_body, json_response, read_body
from kinfer.producers.openai_api import openai_decode
from kinfer.topics import InvalidRequest, Unavailable
from kinfer.topics.batches import (
    COMPLETION_WINDOW_MS,
    ENDPOINTS,
    MAX_FILE_BYTES,
    BatchObject,
    FileObject,
    valid_batch_id,
    valid_file_id,
)

MAX_LIST = 100  # batches one list call returns
MAX_FILE_LIST = 10_000  # files one list call returns (OpenAI's bound, and its default)
MAX_FILENAME_BYTES = 255  # a stored filename, in UTF-8
MAX_TENANT_FILES = 10_000  # files a tenant may hold (its batches' outputs count)
MAX_TENANT_BYTES = 16 * 1024**3  # bytes they may hold together
MAX_TENANT_TRANSFERS = 4  # uploads and downloads of one tenant open at once, on one gateway
T = TypeVar("T", FileObject, BatchObject)


class CreateBatchBody(msgspec.Struct, kw_only=True):
    input_file_id: Annotated[str, msgspec.Meta(max_length=64)]
    endpoint: Annotated[str, msgspec.Meta(max_length=64)]
    completion_window: Annotated[str, msgspec.Meta(max_length=16)] = "24h"
    metadata: Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
                        msgspec.Meta(max_length=16)] | None = None


def _not_found(kind: str, what: str) -> Response:
    return json_response(error_body("not_found", f"no {kind} {what[:80]!r}", "id"), 404)


def _check_purpose(fields: Mapping[str, str], final: bool) -> None:
    """The form's ``purpose``: ``batch`` (once the form has ended, it must be there)."""
    purpose = fields.get("purpose")
    if (purpose is not None or final) and purpose != "batch":
        raise InvalidRequest(f"purpose must be 'batch', got {str(purpose)[:32]!r}", "purpose")


def clean_filename(name: str | None) -> str:
    """A multipart filename as it is stored: valid UTF-8 (a lone surrogate, which a ``charset`` such as
    utf-7 can decode to, becomes "?"), no control characters, at most ``MAX_FILENAME_BYTES`` bytes (cut
    at a character), and never empty."""
    text = (name or "").encode("utf-8", "replace").decode("utf-8")
    text = "".join(c for c in unicodedata.normalize("NFC", text) if unicodedata.category(c)[0] != "C").strip()
    text = text.encode("utf-8")[:MAX_FILENAME_BYTES].decode("utf-8", "ignore")
    return text or "input.jsonl"


def _page(request: Request, items: list[T], most: int, default: int) -> dict[str, object]:
    """One page of ``items`` (newest first) as OpenAI lists them: ``limit`` and ``after`` (an id)."""
    limit = ascii_int(request.query_params.get("limit", str(default)), 1, most)
    if limit is None:
        raise InvalidRequest(f"limit must be a whole number within 1..{most}", "limit")
    after = request.query_params.get("after")
    if after is not None:
        ids = [item.id for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": [item.to_openai() for item in page],
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
            "has_more": len(items) > limit}


class BatchAPI:
    """The routes; ``store`` is the gateway's view of files and batches."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._transfers: Counter[str] = Counter()  # tenant -> uploads and downloads open now

    def _room(self, tenant: str) -> None:
        """429 when ``tenant`` has ``MAX_TENANT_TRANSFERS`` uploads and downloads open already."""
        if self._transfers[tenant] >= MAX_TENANT_TRANSFERS:
            raise RateLimited(f"tenant {tenant!r} has {MAX_TENANT_TRANSFERS} uploads and downloads open: "
                              "finish one first", retry_after_s=1.0)

    @contextlib.contextmanager
    def _transfer(self, tenant: str) -> Iterator[None]:
        """One of ``tenant``'s open transfers, for as long as it lasts (429 past ``MAX_TENANT_TRANSFERS``)."""
        self._room(tenant)
        self._transfers[tenant] += 1
        try:
            yield
        finally:
            self._release(tenant)

    def _release(self, tenant: str) -> None:
        self._transfers[tenant] -= 1
        if not self._transfers[tenant]:
            del self._transfers[tenant]

    @property
    def store(self) -> BatchStore:
        store = self.gateway.batches
        if store is None or not store.ready.is_set():
            raise Unavailable("the batch store is starting")
        return store

    async def _caller(self, request: Request, route: str) -> str:
        """The caller's tenant: authenticated (401 otherwise), and charged one request of its rate (429)."""
        who = self.gateway.authenticate(request.headers)
        return await self.gateway.admit(who, route)

    @staticmethod
    def _own(tenant: str, table: Mapping[str, T], key: str, valid: Callable[[str], bool]) -> T | None:
        """``tenant``'s entry ``key`` of ``table``: None for an id that is malformed, unknown or another's."""
        found = table.get(key) if valid(key) else None
        return found if found is not None and found.tenant == tenant else None

    @staticmethod
    def _mine(tenant: str, table: Mapping[str, T]) -> list[T]:
        """``tenant``'s entries of ``table``, newest first."""
        return sorted((e for e in table.values() if e.tenant == tenant), key=lambda e: (e.created_at, e.id),
                      reverse=True)

    # -- files --------------------------------------------------------------------------------------

    async def upload(self, request: Request) -> Response:
        tenant = await self._caller(request, "files")
        store = self.store
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise InvalidRequest("the upload must be a multipart/form-data form (purpose, file)", "file")
        held = [f for f in store.view.files.values() if f.tenant == tenant]
        if len(held) >= MAX_TENANT_FILES or sum(f.bytes for f in held) >= MAX_TENANT_BYTES:
            raise RateLimited(f"tenant {tenant!r} holds {len(held)} files: at its storage limit "
                              f"({MAX_TENANT_FILES} files, {MAX_TENANT_BYTES} bytes); delete some first",
                              retry_after_s=60.0)
        with self._transfer(tenant):  # from its first byte to its last chunk in Kafka
            meta = await self._store_upload(request, store, tenant)
        return json_response(meta.to_openai())

    @staticmethod
    async def _store_upload(request: Request, store: BatchStore, tenant: str) -> FileObject:
        """The form read as it arrives, its file passed on to Kafka a chunk at a time (``FileWriter``): the
        gateway holds about a chunk of it, not the file. A ``purpose`` that comes before the file (as
        clients send it) is checked before anything is written; whatever makes the upload fail later
        (a bad form, a file over its bound, a caller that hangs up or stalls) discards what was
        written. The file exists, for every gateway, only once its record is written, last."""
        try:
            form = StreamedForm(request.headers.get("content-type", ""))
        except FormRefused as exc:
            raise InvalidRequest(f"the upload must be a multipart/form-data form (purpose, file): {exc}",
                                 "file") from None
        writer = store.writer(tenant, "batch")
        try:
            async for piece in body_pieces(request, MAX_FILE_BYTES + 65_536):
                data = form.feed(piece)
                _check_purpose(form.fields, final=False)
                for part in data:
                    await writer.write(part)
            form.finish()
            _check_purpose(form.fields, final=True)
            if form.filename is None:
                raise InvalidRequest("the form has no file", "file")
            return await writer.finish(clean_filename(form.filename))
        except FormRefused as exc:
            await writer.discard()
            raise InvalidRequest(f"not a multipart form: {exc}", "file") from None
        except FileTooLarge as exc:
            await writer.discard()
            raise BadBody(str(exc), "file", 413) from None
        except BaseException:
            await writer.discard()
            raise

    async def _file(self, request: Request) -> FileObject | None:
        tenant = await self._caller(request, "files")
        return self._own(tenant, self.store.view.files, request.path_params["file_id"], valid_file_id)

    async def get_file(self, request: Request) -> Response:
        meta = await self._file(request)
        return json_response(meta.to_openai()) if meta else _not_found("file", request.path_params["file_id"])

    async def list_files(self, request: Request) -> Response:
        tenant = await self._caller(request, "files")
        return json_response(_page(request, self._mine(tenant, self.store.view.files), MAX_FILE_LIST, MAX_FILE_LIST))

    async def content(self, request: Request) -> Response:
        """The file's bytes, streamed a chunk at a time as the caller reads them: a caller that does not read
        holds one chunk of the gateway's memory, and one of its tenant's transfers."""
        meta = await self._file(request)
        if meta is None:
            return _not_found("file", request.path_params["file_id"])
        if not self.store.readable(meta):
            raise Unavailable(f"{meta.id} cannot be read now: chunks are missing")
        self._room(meta.tenant)  # 429 now, before a byte is sent

        async def body() -> AsyncIterator[bytes]:
            self._transfers[meta.tenant] += 1  # held while it is read (counted from its first byte)
            try:
                async for chunk in self.store.chunks(meta):
                    yield chunk
            finally:
                self._release(meta.tenant)

        return StreamingResponse(body(), media_type="application/octet-stream",
                                 headers={"Content-Length": str(meta.bytes)})

    async def delete_file(self, request: Request) -> Response:
        meta = await self._file(request)
        if meta is None:
            return _not_found("file", request.path_params["file_id"])
        await self.store.delete_file(meta)
        return json_response({"id": meta.id, "object": "file", "deleted": True})

    # -- batches ------------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        tenant = await self._caller(request, "batches")
        store = self.store
        body = openai_decode(await read_body(request), CreateBatchBody)
        if body.endpoint not in ENDPOINTS:
            raise InvalidRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if body.completion_window != "24h":
            raise InvalidRequest("completion_window must be '24h'", "completion_window")
        meta = store.view.files.get(body.input_file_id) if valid_file_id(body.input_file_id) else None
        if meta is None or meta.tenant != tenant or meta.purpose != "batch":
            raise InvalidRequest(f"no batch input file {body.input_file_id[:64]!r}", "input_file_id")
        now = int(time.time())
        batch = BatchObject(id=new_id("batch_"), tenant=tenant, endpoint=body.endpoint, input_file_id=meta.id,
                            created_at=now, expires_at=now + COMPLETION_WINDOW_MS // 1000, status="validating",
                            reply_key=os.urandom(16), metadata=body.metadata)
        await store.put_batch(batch)
        return json_response(batch.to_openai())

    async def _batch(self, request: Request) -> BatchObject | None:
        tenant = await self._caller(request, "batches")
        return self._own(tenant, self.store.view.batches, request.path_params["batch_id"], valid_batch_id)

    async def get_batch(self, request: Request) -> Response:
        batch = await self._batch(request)
        return json_response(batch.to_openai()) if batch else _not_found("batch", request.path_params["batch_id"])

    async def list_batches(self, request: Request) -> Response:
        tenant = await self._caller(request, "batches")
        return json_response(_page(request, self._mine(tenant, self.store.view.batches), MAX_LIST, 20))

    async def cancel(self, request: Request) -> Response:
        batch = await self._batch(request)
        if batch is None:
            return _not_found("batch", request.path_params["batch_id"])
        if batch.terminal:
            return json_response(error_body("invalid_request", f"batch {batch.id} is {batch.status}: it cannot be "
                                            "cancelled", "batch_id"), 409)
        return json_response((await self.store.cancel(batch)).to_openai())
