"""The OpenAI-compatible routes: what the official ``openai`` package calls, answered in OpenAI's shapes.

    GET  /v1/models, /v1/models/{model}   models.list and models.retrieve (``Models``)
    POST /v1/embeddings                   embeddings (``EMBEDDINGS``)
    POST /v1/completions                  text completions, ``stream: true`` for SSE (``COMPLETIONS``)
    POST /v1/chat/completions             chat completions, ``stream: true`` for SSE (``CHAT_COMPLETIONS``)

The three POST routes go through ``Gateway.serve``, at standard priority (OpenAI's bodies name none).
A body that does not match its schema is OpenAI's 400 naming ``param`` (``openai_decode``), and an
option kinfer does not implement is refused by name when it asks for more than its default, never
silently ignored. A completion and a chat completion are one generation each; their answers differ
only in form (``TextCompletion``, ``ChatCompletion``), whole or streamed.
"""

from __future__ import annotations

import abc
import base64
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response

from kinfer.producers.gateway_pipeline import (
    MAX_NAME_CHARS,
    Admitted,
    Gateway,
    Route,
    Streamed,
    Text,
    Texts,
    sse_response,
)
from kinfer.producers.http import BadBody, decode, json_response
from kinfer.topics import Chunk, InvalidRequest, Result, Turn, UnknownModel

OPENAI_PRIORITY = 1  # OpenAI's bodies name no priority: standard
MAX_OPENAI_STOPS = 4  # OpenAI's stop: at most four sequences ...
MAX_OPENAI_STOP_CHARS = 255  # ... of 255 characters: joined by U+001F they fit one parameter (1,024 characters)
MAX_TOOLS = 128  # OpenAI's tools (refused unless empty; counted before that)
MAX_LOGIT_BIAS = 1_024  # OpenAI's logit_bias entries (refused unless empty)
# The workers' sampling ranges (WIRE_FORMAT.md), checked here too so that an OpenAI body is refused
# naming its field, before it is sent: temperature 0 or within [MIN_TEMPERATURE, 2] (OpenAI's top),
# top_p within [MIN_TOP_P, 1].
MIN_TEMPERATURE = 1e-4
MIN_TOP_P = 1e-6

ModelName = Annotated[str, Meta(min_length=1, max_length=63)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]  # OpenAI's user, name, types and the like
Stop = Annotated[str, Meta(max_length=MAX_OPENAI_STOP_CHARS)]


# -- bodies ---------------------------------------------------------------------------------

# Fields OpenAI's bodies do not define are skipped, not refused (OpenAI's clients send fields newer
# than this server). msgspec skips an unknown value without building it; its nesting is bounded like
# the rest of the document (``producers.http.decode``), and its size by ``MAX_BODY_BYTES``.


class EmbeddingsBody(msgspec.Struct):
    model: ModelName
    input: Texts
    encoding_format: Literal["float", "base64"] = "float"
    user: Name | None = None
    dimensions: int | None = None  # refused: the model's vectors have the size they have

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ToolFunction(msgspec.Struct):
    name: Name  # its description and JSON-schema parameters are skipped: tools are refused anyway


class Tool(msgspec.Struct):
    type: Name
    function: ToolFunction | None = None


class ToolChoice(msgspec.Struct):
    type: Name
    function: ToolFunction | None = None


class ResponseFormat(msgspec.Struct):
    type: Name  # its json_schema is skipped: any type but "text" is refused


class _Generation(msgspec.Struct, kw_only=True):
    """What OpenAI's completion and chat bodies share: sampling, streaming, and options kinfer refuses."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0  # and 0 or >= MIN_TEMPERATURE
    top_p: Annotated[float, Meta(ge=MIN_TOP_P, le=1.0)] = 1.0
    stop: Stop | Annotated[list[Stop], Meta(max_length=MAX_OPENAI_STOPS)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**62)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # OpenAI fields kinfer does not implement: refused with a 400 when they ask for anything but the default.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Annotated[dict[Name, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None

    def _asked(self) -> dict[str, bool]:
        """Each unimplemented field, and whether the body asks for more than its default."""
        return {"n": self.n != 1, "presence_penalty": self.presence_penalty != 0,
                "frequency_penalty": self.frequency_penalty != 0, "logit_bias": bool(self.logit_bias),
                "stream_options": self.stream_options is not None and not self.stream}

    def unsupported(self) -> str | None:
        """The first field asking for something kinfer does not do (never silently ignored)."""
        return next((name for name, wanted in self._asked().items() if wanted), None)

    def params(self, max_tokens: int) -> dict[str, str | int | float | None]:
        """The request's generation ``params`` (WIRE_FORMAT.md)."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        params: dict[str, str | int | float | None] = {"max_new_tokens": max_tokens, "temperature": self.temperature,
                                                       "top_p": self.top_p, "seed": self.seed}
        if joined := "\x1f".join(s for s in stops if s):
            params["stop"] = joined
        return params

    def out_of_range(self) -> InvalidRequest | None:
        """What the schema cannot say: a temperature between 0 and the workers' least."""
        if 0 < self.temperature < MIN_TEMPERATURE:
            return InvalidRequest(f"temperature must be 0 (greedy) or within [{MIN_TEMPERATURE}, 2], "
                                  f"got {self.temperature!r}", "temperature")
        return None

    def check(self) -> None:
        """Refuse, naming the field, what ``unsupported`` and ``out_of_range`` find."""
        if (field := self.unsupported()) is not None:
            raise InvalidRequest(f"{field} is not supported by this server (use its default)", field)
        if (refused := self.out_of_range()) is not None:
            raise refused

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk carrying the usage (``stream_options.include_usage``)."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionsBody(_Generation, kw_only=True):
    model: ModelName
    prompt: Text
    max_tokens: Annotated[int, Meta(ge=1, le=4096)] = 16
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def _asked(self) -> dict[str, bool]:
        return {**super()._asked(), "best_of": self.best_of not in (None, 1), "logprobs": self.logprobs is not None,
                "echo": self.echo, "suffix": self.suffix is not None}


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text
    name: Name | None = None


class ChatCompletionsBody(_Generation, kw_only=True):
    model: ModelName
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=256)]
    max_tokens: Annotated[int, Meta(ge=1, le=4096)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1, le=4096)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Name | ToolChoice | None = None
    response_format: ResponseFormat | None = None

    def _asked(self) -> dict[str, bool]:
        return {**super()._asked(), "logprobs": self.logprobs, "top_logprobs": self.top_logprobs is not None,
                "tools": bool(self.tools), "tool_choice": self.tool_choice not in (None, "none"),
                "response_format": self.response_format is not None and self.response_format.type != "text"}


T = TypeVar("T")

# What OpenAI's API takes in these fields and kinfer does not: said so, not a schema error.
_UNSUPPORTED_SHAPES = {
    "prompt": "prompt must be one string: a list of prompts (use n requests) and token ids are not supported",
    "input": "input must be a string or a list of strings: token ids are not supported",
}


def openai_decode(data: bytes, kind: type[T]) -> T:
    """``decode`` for the OpenAI routes: a body that does not match is OpenAI's 400
    (``invalid_request_error`` naming ``param``), and the input shapes OpenAI takes that kinfer does
    not are named as such."""
    try:
        return decode(data, kind)
    except BadBody as exc:
        if exc.status != 422:
            raise
        text = str(exc)
        if exc.field in _UNSUPPORTED_SHAPES and "got `" in text:  # a type mismatch, not a length
            text = f"{_UNSUPPORTED_SHAPES[exc.field]} ({text})"
        raise InvalidRequest(text, exc.field or "body") from None


# -- models ---------------------------------------------------------------------------------


class Models:
    """``GET /v1/models`` and ``GET /v1/models/{model}``: the models with request topics. Authenticated,
    but neither rate-limited nor counted: no model is called."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def list_models(self, request: Request) -> Response:
        self.gateway.authenticate(request.headers)
        names = await self.gateway.client.models()
        return json_response(
            {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "kinfer"} for m in names]}
        )

    async def retrieve(self, request: Request) -> Response:
        self.gateway.authenticate(request.headers)
        name = request.path_params["model"]
        if name not in await self.gateway.client.models():
            raise UnknownModel(f"model {name!r} is not served", "model")
        return json_response({"id": name, "object": "model", "created": 0, "owned_by": "kinfer"})


# -- embeddings -----------------------------------------------------------------------------


def _decode_embeddings(data: bytes) -> EmbeddingsBody:
    body = openai_decode(data, EmbeddingsBody)
    if body.dimensions is not None:
        raise InvalidRequest("dimensions is not supported: the model's vectors have a fixed size", "dimensions")
    return body


async def _embed(call: Admitted, body: EmbeddingsBody) -> Result:
    return await call.infer(body.model, body.texts(), deadline_ms=call.deadline_ms(),
                            priority=call.priority(OPENAI_PRIORITY))


def _render_embeddings(body: EmbeddingsBody, result: Result) -> Response:
    return json_response(embeddings_answer(body, result))


def embeddings_answer(body: EmbeddingsBody, result: Result) -> dict[str, Any]:
    """OpenAI's embeddings response for a result (the HTTP route's and a batch's output line's)."""
    if not all(isinstance(v, list) for v in result.outputs):
        raise InvalidRequest(f"model {body.model!r} does not produce embeddings", "model")
    # The tokenizer's count where the model reports it; else words, the nearest thing without one.
    tokens = result.tokens or sum(len(t.split()) for t in body.texts())
    return {
        "object": "list", "model": body.model,
        "data": [{"object": "embedding", "index": i, "embedding": _vector(v, body.encoding_format)}
                 for i, v in enumerate(result.outputs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # what the openai package asks for: float32, little-endian
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


EMBEDDINGS: Route[EmbeddingsBody, Result] = Route("embeddings", _decode_embeddings, _embed, _render_embeddings)


# -- completions and chat completions -------------------------------------------------------


class CompletionForm(abc.ABC):
    """The shape of one generation's answer, whole or streamed: what text and chat completions differ in."""

    object: ClassVar[str]  # the whole answer's "object"
    chunk_object: ClassVar[str]  # a streamed chunk's
    id_prefix: ClassVar[str]

    def __init__(self, model: str, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.head = {"id": f"{self.id_prefix}-{uuid.uuid4().hex}", "object": self.object,
                     "created": int(time.time()), "model": model}
        self.chunk_head = {**self.head, "object": self.chunk_object}

    @abc.abstractmethod
    def choice(self, text: str, finish: str) -> dict[str, Any]:
        """The one choice of a whole answer."""

    @abc.abstractmethod
    def chunk_choice(self, chunk: Chunk, finish: str | None) -> dict[str, Any]:
        """The one choice of a streamed chunk."""

    def whole(self, result: Result) -> Response:
        return json_response(self.answer(result))

    def answer(self, result: Result) -> dict[str, Any]:
        """The whole answer for a result (the HTTP route's and a batch's output line's)."""
        out = result.outputs[0] if result.outputs else None
        if not isinstance(out, dict) or "text" not in out:
            raise InvalidRequest(f"model {self.model!r} is not a generative model", "model")
        return {**self.head, "choices": [self.choice(out["text"], _finish(out["finish"]))],
                "usage": _usage(out["prompt_tokens"], out["completion_tokens"])}

    def events(self, chunk: Chunk) -> list[dict[str, Any]]:
        """The events one chunk stands for."""
        finish = _finish(chunk.finish) if chunk.final else None
        events: list[dict[str, Any]] = [{**self.chunk_head, "choices": [self.chunk_choice(chunk, finish)]}]
        if self.include_usage:  # OpenAI's convention: usage null on every chunk, then a last one with it
            events[0]["usage"] = None
            if chunk.final:
                usage = _usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                events.append({**self.chunk_head, "choices": [], "usage": usage})
        return events


class TextCompletion(CompletionForm):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}

    def chunk_choice(self, chunk: Chunk, finish: str | None) -> dict[str, Any]:
        return self.choice(chunk.text, finish)


class ChatCompletion(CompletionForm):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def choice(self, text: str, finish: str) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def chunk_choice(self, chunk: Chunk, finish: str | None) -> dict[str, Any]:
        delta = {"role": "assistant", "content": chunk.text} if chunk.seq == 0 else {"content": chunk.text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


@dataclass(frozen=True, slots=True)
class Generation:
    """A completion or chat body, checked: what to generate, and the form its answer takes."""

    body: CompletionsBody | ChatCompletionsBody
    prompt: str | None  # a completion's; None for a chat, whose turns the worker renders
    turns: list[Turn]
    max_tokens: int
    form: CompletionForm


def _decode_completion(data: bytes) -> Generation:
    body = openai_decode(data, CompletionsBody)
    body.check()
    return Generation(body, body.prompt, [], body.max_tokens, TextCompletion(body.model, body.include_usage))


def _decode_chat(data: bytes) -> Generation:
    body = openai_decode(data, ChatCompletionsBody)
    body.check()
    # The worker renders the turns with the model's own chat template (developer is OpenAI's new
    # name for system).
    turns = [Turn("system" if m.role == "developer" else m.role, m.content) for m in body.messages]
    max_tokens = body.max_completion_tokens or body.max_tokens or 16
    return Generation(body, None, turns, max_tokens, ChatCompletion(body.model, body.include_usage))


async def _generate(call: Admitted, g: Generation) -> Result | Streamed:
    options: dict[str, Any] = {"messages": g.turns, "priority": call.priority(OPENAI_PRIORITY),
                               "deadline_ms": call.deadline_ms(), "params": g.body.params(g.max_tokens)}
    if g.body.stream:
        return await call.stream(g.body.model, g.prompt, **options)
    return await call.infer(g.body.model, () if g.prompt is None else [g.prompt], **options)


def _render_generation(g: Generation, answer: Result | Streamed) -> Response:
    if isinstance(answer, Streamed):
        return sse_response(answer, g.form.events)
    return g.form.whole(answer)


COMPLETIONS: Route[Generation, Result | Streamed] = Route(
    "completions", _decode_completion, _generate, _render_generation,
)
CHAT_COMPLETIONS: Route[Generation, Result | Streamed] = Route("chat", _decode_chat, _generate, _render_generation)


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
