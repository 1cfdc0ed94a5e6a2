"""Sentence embeddings from any Hugging Face encoder: mean pooling over real tokens, L2-normalised.

That is the recipe all-MiniLM-L6-v2 was trained with (its ``1_Pooling`` config says mean pooling,
``modules.json`` adds ``Normalize``), so the vectors match sentence-transformers' own.

Two runtimes serve the same weights (the ``runtime`` option):

* ``torch``: the model in eager PyTorch.
* ``onnx``: the encoder and the pooling exported to ONNX from those weights at first use, cached on
  disk, and run by ONNX Runtime. CPU only. On a 2-core CPU with one intra-op thread each it served
  all-MiniLM-L6-v2 1.5-1.9x faster than torch eager at batch 1 (1.15-1.25x at batch 8), tokenisation included.
  The first load in a process checks it against torch (cosine >= ``ONNX_MIN_COSINE`` per output; a
  later load of the unchanged export, a swap-in, reopens it alone) and falls back to
  torch, with a warning, when it disagrees or cannot be exported.
* ``onnx-int8``: the same export with its weight matrices quantized to int8 (ONNX Runtime's dynamic
  quantization: per output channel, activations quantized at run time), made once beside it. On the
  same CPU it served all-MiniLM-L6-v2 2.2-2.5x the sequences of ``onnx`` at batch 1; the vectors move a
  little (cosine against torch 0.988 at worst, 0.993 on average, over 300 texts of 5-60 words), so it
  is checked against a lower bar (``ONNX_INT8_MIN_COSINE``) and is never chosen by ``auto``.
* ``auto`` (default): ``onnx`` on CPU when onnxruntime is installed and the model is an encoder, else torch.

``runner.runtime`` says which one is serving once ``load()`` has returned.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer

from kinfer.consumers.runners.base import TorchResidency, choose_attention, drop_weights, estimate_tokens, to_device
from kinfer.consumers.runners.tokenize import BatchTokenizer, Encoded, length_buckets
from kinfer.topics.paths import cache_dir

log = logging.getLogger(__name__)

RUNTIMES = ("auto", "torch", "onnx", "onnx-int8")
# Graphs this process has checked against torch: the graph's file -> (its mtime in ns, the bar it passed).
_CHECKED: dict[Path, tuple[int, float]] = {}
ONNX_MIN_COSINE = 0.9999  # per output, ONNX Runtime against torch on the same texts
ONNX_INT8_MIN_COSINE = 0.97  # the int8 graph's bar (its worst measured: 0.988)
# The graph each ONNX runtime serves, in the export's cache entry (the int8 one is made from the other).
ONNX_GRAPHS = {"onnx": "model.onnx", "onnx-int8": "model.int8.onnx"}
ONNX_OPSET = 18
# Part of the cache key: bump it when the exported graph changes (inputs, pooling), so no stale export is reused.
ONNX_EXPORT_FORMAT = 1
# ONNX Runtime graph rewrites left out. Fusing each residual Add into its LayerNormalization
# (SkipLayerNormalization) made the CPU kernel 6x slower than the two ops it replaced (an ORT profile of
# all-MiniLM-L6-v2, one thread: 186 ms against 29 ms over 200 texts); without it the model serves 10-15 %
# more sequences a second at batch 1 and 15-18 % more at batch 4 and 16. ORT ignores a name it does not
# know, so a test checks the optimized graph holds no such op.
ORT_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)
# Files of a model directory whose content decides the exported graph (the weights and the architecture).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_ONNX_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# The load-time self-check: short and long, alone and padded together (padding is where exports go wrong).
_PROBE_TEXTS = (
    "hi",
    "Kafka partitions are consumed by exactly one member of a consumer group at a time.",
    "The worker batches requests, runs one forward pass and replies through Redis; "
    "offsets are committed only after every reply of the batch has been written, so a crash "
    "replays work instead of losing it. " * 3,
    "naïve café — unicode, numbers 12345 and punctuation?!",
)


def onnx_cache_root() -> Path:
    """Where exported models are kept: ``onnx`` in ``topics.paths.cache_dir()`` (``$KINFER_CACHE``, else
    ``$KINFER_HOME``, else ``~/.cache/kinfer``)."""
    return cache_dir() / "onnx"


def _pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real tokens, then L2 normalisation (float32)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled.float(), p=2, dim=1)


class _Pooled(torch.nn.Module):
    """The encoder followed by the runner's pooling: the exported graph returns finished vectors."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        kwargs = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        return _pool(hidden, attention_mask)


def onnx_cache_dir(model_dir: Path) -> Path:
    """The cache entry of ``model_dir``: its path plus a hash of its weights' and config's contents (and of
    the torch/transformers versions and export format that shaped the graph)."""
    model_dir = model_dir.resolve()
    h = hashlib.sha256()
    for part in (str(model_dir), torch.__version__, _transformers_version(), str(ONNX_EXPORT_FORMAT)):
        h.update(part.encode() + b"\0")
    files = [p for p in sorted(model_dir.iterdir()) if p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json"]
    if not any(p.suffix in _WEIGHT_SUFFIXES for p in files):
        raise FileNotFoundError(f"no weight files in {model_dir}")
    for p in files:
        with p.open("rb") as f:
            h.update(p.name.encode() + b"\0" + hashlib.file_digest(f, "sha256").digest())
    return onnx_cache_root() / f"{model_dir.parent.name}.{model_dir.name}-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _quiet_exporter_logs() -> Iterator[None]:
    """The exporter logs every graph rewrite at INFO (hundreds of lines in a worker's log); keep its warnings."""
    loggers = [logging.getLogger(name) for name in ("onnx_ir", "onnxscript", "torch.onnx")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def open_session(model: Path, threads: int, optimized_to: Path | None = None,
                 disabled: tuple[str, ...] = ORT_DISABLED_OPTIMIZERS) -> Any:
    """An ONNX Runtime session on the CPU for an exported model, ``threads`` for each operator, run one
    operator at a time; ``optimized_to``: also write the graph as ORT rewrote it there (tests read it)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # ORT's pool spins while it waits for work by default: with a few requests a second, two
    # threads burnt 1.5 cores in a worker (bench serve); the cores belong to the transport too.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3  # errors only: its warnings about pruned initializers are noise
    if optimized_to is not None:
        opts.optimized_model_filepath = str(optimized_to)
    return ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(disabled))


@contextlib.contextmanager
def _one_exporter(entry: Path) -> Iterator[None]:
    """Held while exporting to ``entry``: the cache folder's lock, so another process (or thread) exporting
    waits, then finds the export in place. Where the folder cannot be locked, each one exports, as the
    rename into place already allows."""
    import fcntl
    import os

    entry.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(entry.parent, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class _From(logging.Filter):
    def __init__(self, package: str) -> None:
        super().__init__()
        self.part = f"/{package}/"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.part not in record.pathname


@contextlib.contextmanager
def _without_root_records_from(package: str) -> Iterator[None]:
    """``package`` logs on the root logger (ONNX Runtime's quantizer: a line per tensor at INFO); its
    records are dropped while the block runs, everyone else's kept."""
    root, drop = logging.getLogger(), _From(package)
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


def quantize_int8(fp32: Path, int8: Path) -> None:
    """``fp32``'s weight matrices as int8 into ``int8`` (written beside it, then renamed into place).
    Only matrix products with a constant operand (the weights) are quantized; the attention's
    activation-by-activation products stay float. Scales are per output channel: one scale per matrix
    moved MiniLM's vectors to a cosine of 0.918 at worst against 0.988 (300 texts), at the same speed."""
    import os

    from onnxruntime.quantization import QuantType, quantize_dynamic

    t0 = time.perf_counter()
    scratch = int8.with_name(f".{int8.name}.{os.getpid()}.tmp")
    try:
        with warnings.catch_warnings(), _without_root_records_from("onnxruntime"):
            warnings.simplefilter("ignore")
            quantize_dynamic(fp32, scratch, weight_type=QuantType.QInt8, per_channel=True,
                             extra_options={"MatMulConstBOnly": True})
        os.replace(scratch, int8)
    finally:
        scratch.unlink(missing_ok=True)
    log.info("%s: quantized to int8 in %.1f s -> %s", fp32.parent, time.perf_counter() - t0, int8)


def onnx_available() -> bool:
    return importlib.util.find_spec("onnxruntime") is not None


def _cosines(a: Any, b: Any) -> list[float]:
    ta, tb = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(ta, tb, dim=1).tolist()


class EmbeddingRunner(TorchResidency):
    family = "embedding"

    def __init__(self, path: str | Path, device: str = "cpu", max_length: int = 256, runtime: str = "auto") -> None:
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
        if runtime.startswith("onnx") and device != "cpu":
            raise ValueError(f"runtime {runtime!r} runs on the CPU only, not on {device!r}")
        self.path = str(path)
        self.device = device
        self.max_length = int(max_length)  # all-MiniLM-L6-v2 was trained on 256-token windows
        self.requested_runtime = runtime
        self.runtime = runtime  # what serves: "torch", "onnx" or "onnx-int8" once load() has returned
        self._graph = "onnx-int8" if runtime == "onnx-int8" else "onnx"  # the ONNX runtime it would be
        self.onnx_exported = False  # whether load() exported the model (False: taken from the cache)
        # fp16 halves memory traffic on a GPU; CPUs have no fast fp16 matmul, so they stay fp32.
        self.dtype = torch.float16 if device.startswith("cuda") else torch.float32
        self._tokenizer: Any = None
        self._encoder: BatchTokenizer | None = None  # from load(): the Rust batch encoder, shared by every thread
        self._model: Any = None
        self._session: Any = None  # an onnxruntime.InferenceSession when runtime is "onnx"
        self._onnx_inputs: list[str] = []
        self._onnx_bytes = 0

    def load(self) -> None:
        self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        # A GPU pads to a few bucketed lengths (each warmed once); a CPU to each batch's longest text.
        buckets = None if self.device == "cpu" else length_buckets(self.max_length)
        self._encoder = BatchTokenizer(self._tokenizer, self.max_length, buckets)
        choose_attention(self.device)
        self.runtime = "torch"
        wants_onnx = self._wants_onnx()
        if wants_onnx and self._reopen_checked_export():
            self.runtime = self._graph
            log.info("%s: embedding runtime %s (export checked earlier in this process)", self.path, self.runtime)
            return
        self._model = AutoModel.from_pretrained(self.path, dtype=self.dtype).to(self.device).eval()
        if wants_onnx:
            try:
                self._load_onnx()
            except Exception as e:
                # Raised before any ONNX output is served: the torch model loaded above serves instead.
                self._session = None
                log.warning("%s: ONNX Runtime unavailable (%s: %s); serving with torch", self.path, type(e).__name__, e)
        if self._session is not None:
            self.runtime = self._graph
            self._model = None  # the session holds its own copy of the weights
        log.info("%s: embedding runtime %s", self.path, self.runtime)

    def _wants_onnx(self) -> bool:
        if self.requested_runtime == "torch":
            return False
        if self.requested_runtime in ONNX_GRAPHS:
            if not onnx_available():
                raise RuntimeError(f"runtime {self.requested_runtime!r} needs the onnxruntime package "
                                   "(pip install onnxruntime)")
            return True
        config = AutoConfig.from_pretrained(self.path)
        encoder = not (getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False))
        return self.device == "cpu" and encoder and onnx_available() and Path(self.path).is_dir()

    def _reopen_checked_export(self) -> bool:
        """A model swapped back in from disk: its export, unchanged since this process checked it against
        torch, is opened without loading the torch weights or checking again (most of a load's time)."""
        graph = onnx_cache_dir(Path(self.path)) / ONNX_GRAPHS[self._graph]
        if not graph.is_file() or _CHECKED.get(graph) != (graph.stat().st_mtime_ns, self._min_cosine()):
            return False
        self._open_session(graph)
        return True

    def _min_cosine(self) -> float:
        return ONNX_INT8_MIN_COSINE if self._graph == "onnx-int8" else ONNX_MIN_COSINE

    def _load_onnx(self) -> None:
        entry = onnx_cache_dir(Path(self.path))
        graph = entry / ONNX_GRAPHS[self._graph]
        if not graph.is_file():
            with _one_exporter(entry):  # workers starting together on a host export (and quantize) once
                if not (entry / "model.onnx").is_file():
                    self._export(entry)
                if not graph.is_file():
                    quantize_int8(entry / "model.onnx", graph)
        self._open_session(graph)
        self._self_check()
        if self._session is not None:
            _CHECKED[graph] = (graph.stat().st_mtime_ns, self._min_cosine())

    def _open_session(self, graph: Path) -> None:
        # One setting governs both runtimes: the worker sizes torch's pool (set_threads) before load().
        session = open_session(graph, torch.get_num_threads())
        self._onnx_inputs = [i.name for i in session.get_inputs()]
        # The graph and its external weights (the dynamo exporter writes them beside it).
        self._onnx_bytes = sum(f.stat().st_size for f in graph.parent.iterdir() if f.name.startswith(graph.name))
        self._session = session

    def _export(self, entry: Path) -> None:
        """Export the encoder and pooling to ``entry/model.onnx``: written in a scratch folder, renamed into
        place, so a reader (another worker starting at the same time) never sees half a model."""
        t0 = time.perf_counter()
        sample = self._tokenizer(
            ["an export sample", "a longer export sample, so the batch has padding"], padding=True, return_tensors="pt"
        )
        kwargs = {k: sample[k] for k in _ONNX_INPUTS if k in sample}
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
        entry.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        scratch.chmod(0o755)  # mkdtemp's 0700 would follow the rename: a shared $KINFER_HOME stays readable
        try:
            with warnings.catch_warnings(), _quiet_exporter_logs():
                warnings.simplefilter("ignore")  # the exporter's notes on dynamic axes and tracing
                torch.onnx.export(
                    _Pooled(self._model),
                    (),
                    str(scratch / "model.onnx"),
                    kwargs=kwargs,
                    input_names=list(kwargs),
                    output_names=["sentence_embedding"],
                    dynamic_shapes={k: {0: batch, 1: seq} for k in kwargs},
                    opset_version=ONNX_OPSET,
                    dynamo=True,
                    verbose=False,
                )
            meta = {
                "model_dir": str(Path(self.path).resolve()),
                "inputs": list(kwargs),
                "opset": ONNX_OPSET,
                "format": ONNX_EXPORT_FORMAT,
                "torch": torch.__version__,
                "transformers": _transformers_version(),
                "export_s": round(time.perf_counter() - t0, 2),
            }
            (scratch / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            try:
                scratch.rename(entry)
            except OSError:
                if not (entry / "model.onnx").is_file():  # not a lost race: a real failure
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self.onnx_exported = True
        log.info("%s: exported to ONNX in %.1f s -> %s", self.path, time.perf_counter() - t0, entry)

    @torch.inference_mode()
    def _self_check(self) -> None:
        """ONNX against torch on the probe texts, padded together and one by one; refuses ONNX below the bar."""
        def both(texts: list[str]) -> list[float]:
            enc = self.tokenize(texts)
            return _cosines(self._embed_onnx(enc), self._embed_torch(enc))

        texts = list(_PROBE_TEXTS)
        worst = min([*both(texts), *(c for t in texts for c in both([t]))])
        if worst < self._min_cosine():
            self._session = None
            log.warning(
                "%s: %s outputs disagree with torch (worst cosine %.6f < %s); serving with torch",
                self.path,
                self._graph,
                worst,
                self._min_cosine(),
            )

    def _weights(self) -> Any:
        return self._model

    def footprint_bytes(self) -> int:
        """torch: the module's tensors; ONNX Runtime: the exported graph, whose initializers are the weights."""
        if self._session is not None:
            return self._onnx_bytes
        return super().footprint_bytes()

    def unload(self) -> None:
        self._model = self._session = None
        drop_weights(self.device)

    def warmup(self) -> None:
        for n, words in ((1, 4), (8, 32), (32, 64)):
            self.run([" ".join(["warmup"] * words)] * n)
        if self._model is not None and self._encoder is not None and self._encoder.buckets:
            for width in self._encoder.buckets:  # every padded length a batch can take, met now
                self._embed_torch(self._encoder.encode_ids(width, rows=8))

    def count_tokens(self, text: str) -> int:
        return estimate_tokens(text, self.max_length)

    def run(self, texts: list[str]) -> list[Any]:
        return self.run_counted(texts)[0]

    def run_counted(self, texts: list[str]) -> tuple[list[Any], list[int]]:
        """The vectors, and the tokens each text became (special tokens and truncation included)."""
        enc = self.tokenize(texts)
        vectors: list[Any] = self.embed(enc).tolist()
        return vectors, enc.lengths.tolist()

    def tokenize(self, texts: list[str]) -> Encoded:
        """The CPU's part of a batch: the texts as padded ids (the Rust batch encoder, on every core)."""
        assert self._encoder is not None
        return self._encoder.encode(texts)

    def embed(self, enc: Encoded) -> Any:
        """The device's part: the vectors of an encoded batch, one float32 array on the host."""
        return self._embed_onnx(enc) if self._session is not None else self._embed_torch(enc)

    def _embed_onnx(self, enc: Encoded) -> Any:
        return self._session.run(None, enc.arrays(self._onnx_inputs))[0]

    @torch.inference_mode()
    def _embed_torch(self, enc: Encoded) -> Any:
        assert self._encoder is not None
        inputs = to_device(enc.arrays(self._encoder.input_names), self.device)
        hidden = self._model(**inputs).last_hidden_state
        return _pool(hidden, inputs["attention_mask"]).cpu().numpy()  # one copy off the device
