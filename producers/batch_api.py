"""OpenAI's Files and Batch API on the gateway, over ``producers.batches`` (the state lives in Kafka).

    POST /v1/files                      upload a batch input file (multipart: ``purpose=batch``, ``file``)
    GET  /v1/files, /v1/files/{id}      the caller's files
    GET  /v1/files/{id}/content         a file's bytes: an input, or a batch's output or error file
    POST /v1/batches                    start a batch: ``input_file_id``, ``endpoint``, ``completion_window``
    GET  /v1/batches, /v1/batches/{id}  the caller's batches, newest first (``limit``, ``after``)
    POST /v1/batches/{id}/cancel        stop it: what has been answered is its output

A tenant sees and touches only its own files and batches (another's id is 404, as an unknown one).
Uploads and new batches pass the tenant's rate limit; every request is bounded before it is read.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Annotated, TypeVar

import msgspec
from msgspec.structs import replace
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import Response

from kinfer.producers.batches import BatchStore, new_id
from kinfer.producers.gateway_pipeline import Gateway
from kinfer.producers.http import BadBody, ascii_int, error_body, json_response, read_body
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

MAX_LIST = 100  # objects one list call returns
T = TypeVar("T", FileObject, BatchObject)


class CreateBatchBody(msgspec.Struct, kw_only=True):
    input_file_id: Annotated[str, msgspec.Meta(max_length=64)]
    endpoint: Annotated[str, msgspec.Meta(max_length=64)]
    completion_window: Annotated[str, msgspec.Meta(max_length=16)] = "24h"
    metadata: Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
                        msgspec.Meta(max_length=16)] | None = None


def _not_found(kind: str, what: str) -> Response:
    return json_response(error_body("not_found", f"no {kind} {what[:80]!r}", "id"), 404)


async def _once(data: bytes) -> AsyncGenerator[bytes, None]:
    yield data


class BatchAPI:
    """The routes; ``store`` is the gateway's view of files and batches."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    @property
    def store(self) -> BatchStore:
        store = self.gateway.batches
        if store is None or not store.ready.is_set():
            raise Unavailable("the batch store is starting")
        return store

    def _tenant(self, request: Request) -> str:
        who = self.gateway.authenticate(request.headers)
        return who.name if who is not None else "anonymous"

    async def _admitted(self, request: Request, route: str) -> str:
        who = self.gateway.authenticate(request.headers)
        return await self.gateway.admit(who, route)

    def _own(self, request: Request, table: Mapping[str, T], key: str, valid: Callable[[str], bool]) -> T | None:
        """The caller's entry ``key`` of ``table``: None for an id that is malformed, unknown or another's."""
        found = table.get(key) if valid(key) else None
        return found if found is not None and found.tenant == self._tenant(request) else None

    def _mine(self, request: Request, table: Mapping[str, T]) -> list[T]:
        """The caller's entries of ``table``, newest first."""
        tenant = self._tenant(request)
        return sorted((e for e in table.values() if e.tenant == tenant), key=lambda e: (e.created_at, e.id),
                      reverse=True)

    # -- files --------------------------------------------------------------------------------------

    async def upload(self, request: Request) -> Response:
        tenant = await self._admitted(request, "files")
        store = self.store
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise InvalidRequest("the upload must be a multipart/form-data form (purpose, file)", "file")
        data = await read_body(request, MAX_FILE_BYTES + 65_536)
        try:
            form = await MultiPartParser(request.headers, _once(data), max_files=1, max_fields=8).parse()
        except MultiPartException as exc:
            raise InvalidRequest(f"not a multipart form: {exc}", "file") from None
        except Exception as exc:  # the parser's own errors on a malformed form: still the caller's
            raise InvalidRequest(f"not a multipart form ({type(exc).__name__})", "file") from None
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise InvalidRequest(f"purpose must be 'batch', got {str(purpose)[:32]!r}", "purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("the form has no file", "file")
        content = await upload.read(MAX_FILE_BYTES + 1)
        if len(content) > MAX_FILE_BYTES:
            raise BadBody(f"the file is over {MAX_FILE_BYTES} bytes", "file", 413)
        meta = await store.put_file(tenant, "batch", upload.filename or "input.jsonl", content)
        return json_response(meta.to_openai())

    def _file(self, request: Request) -> FileObject | None:
        return self._own(request, self.store.view.files, request.path_params["file_id"], valid_file_id)

    async def get_file(self, request: Request) -> Response:
        meta = self._file(request)
        return json_response(meta.to_openai()) if meta else _not_found("file", request.path_params["file_id"])

    async def list_files(self, request: Request) -> Response:
        mine = self._mine(request, self.store.view.files)
        return json_response({"object": "list", "data": [f.to_openai() for f in mine[:10_000]], "has_more": False})

    async def content(self, request: Request) -> Response:
        meta = self._file(request)
        if meta is None:
            return _not_found("file", request.path_params["file_id"])
        try:
            data = await self.store.read_file(meta)
        except (KeyError, TimeoutError) as exc:
            raise Unavailable(f"{meta.id} cannot be read now: {exc}") from None
        return Response(data, media_type="application/octet-stream")

    # -- batches ------------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        tenant = await self._admitted(request, "batches")
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

    def _batch(self, request: Request) -> BatchObject | None:
        return self._own(request, self.store.view.batches, request.path_params["batch_id"], valid_batch_id)

    async def get_batch(self, request: Request) -> Response:
        batch = self._batch(request)
        return json_response(batch.to_openai()) if batch else _not_found("batch", request.path_params["batch_id"])

    async def list_batches(self, request: Request) -> Response:
        limit = ascii_int(request.query_params.get("limit", "20"), 1, MAX_LIST)
        if limit is None:
            raise InvalidRequest(f"limit must be a whole number within 1..{MAX_LIST}", "limit")
        mine = self._mine(request, self.store.view.batches)
        after = request.query_params.get("after")
        if after is not None:
            ids = [b.id for b in mine]
            mine = mine[ids.index(after) + 1:] if after in ids else []
        page = mine[:limit]
        return json_response({"object": "list", "data": [b.to_openai() for b in page],
                              "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                              "has_more": len(mine) > limit})

    async def cancel(self, request: Request) -> Response:
        await self._admitted(request, "batches")
        batch = self._batch(request)
        if batch is None:
            return _not_found("batch", request.path_params["batch_id"])
        if batch.status in ("validating", "in_progress"):
            batch = await self.store.put_batch(replace(batch, status="cancelling", cancelling_at=int(time.time())))
        elif batch.status != "cancelling":
            return json_response(error_body("invalid_request", f"batch {batch.id} is {batch.status}: it cannot be "
                                            "cancelled", "batch_id"), 409)
        return json_response(batch.to_openai())
