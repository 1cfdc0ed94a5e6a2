"""The ONNX Runtime path of the embedding runner against torch, on all-MiniLM-L6-v2."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kinfer.consumers.runners import build_runner, resolve_model
from kinfer.consumers.runners import embedding as emb

pytestmark = pytest.mark.models  # builds or loads real models (tens of seconds): not in `make check`

TEXTS = [
    "hello",
    "Kafka keeps the offsets; the worker commits them only after replying.",
    "a much longer text about consumer groups, partitions, rebalances and the lag they build up " * 4,
    "numbers 3.14159 and punctuation: yes?! (maybe)",
    "short one",
]


def embed(runtime: str) -> Any:
    runner = build_runner(resolve_model("minilm", options={"runtime": runtime}), device="cpu")
    runner.load()
    return runner


def cosines(a: list[list[float]], b: list[list[float]]) -> np.ndarray:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.sum(x * y, axis=1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh cache for this module; the first load in it exports."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("kinfer-home")
        mp.setenv("KINFER_HOME", str(path))
        mp.delenv("KINFER_CACHE", raising=False)  # `make` points it at the checkout's .cache/
        yield path


@pytest.fixture(scope="module")
def exported(home: Path) -> Any:
    runner = embed("onnx")
    assert runner.runtime == "onnx" and runner.onnx_exported
    return runner


@pytest.fixture(scope="module")
def reference() -> Any:
    runner = embed("torch")
    assert runner.runtime == "torch" and not runner.onnx_exported
    return runner


def test_onnx_matches_torch(exported: Any, reference: Any) -> None:
    batched = cosines(exported.run(TEXTS), reference.run(TEXTS))
    alone = cosines([exported.run([t])[0] for t in TEXTS], [reference.run([t])[0] for t in TEXTS])
    assert (batched >= emb.ONNX_MIN_COSINE).all(), batched
    assert (alone >= emb.ONNX_MIN_COSINE).all(), alone
    assert np.allclose(np.linalg.norm(exported.run(TEXTS), axis=1), 1.0, atol=1e-5)


def test_both_runtimes_count_the_tokens_the_tokenizer_makes(exported: Any, reference: Any) -> None:
    """What usage reports: the tokenizer's own count, special tokens and truncation included."""
    tokenizer = reference._tokenizer
    expected = [len(tokenizer(t, truncation=True, max_length=reference.max_length)["input_ids"]) for t in TEXTS]
    assert expected[0] == 3  # [CLS] hello [SEP]
    for runner in (exported, reference):
        vectors, tokens = runner.run_counted(TEXTS)  # batched: padding is not counted
        assert tokens == expected and len(vectors) == len(TEXTS)


def test_second_load_reuses_the_cache(exported: Any, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (entry,) = (home / "onnx").iterdir()
    model = entry / "model.onnx"
    mtime = model.stat().st_mtime_ns

    def no_export(*args: object, **kwargs: object) -> None:
        raise AssertionError("exported a second time")

    monkeypatch.setattr(torch.onnx, "export", no_export)
    again = embed("auto")  # auto: ONNX on a CPU with onnxruntime installed
    assert again.runtime == "onnx" and not again.onnx_exported
    assert model.stat().st_mtime_ns == mtime
    assert [p.name for p in (home / "onnx").iterdir()] == [entry.name]
    assert np.allclose(again.run(TEXTS), exported.run(TEXTS), atol=1e-6)


def test_the_graph_ort_runs_leaves_out_the_slow_fusion(exported: Any, home: Path, tmp_path: Path) -> None:
    """ORT takes any name in its list of rewrites to leave out: the optimized graph is checked, against the
    same export optimized with nothing left out (where the fused op does appear)."""
    import onnx

    (entry,) = (home / "onnx").iterdir()

    def ops(disabled: tuple[str, ...]) -> set[str]:
        optimized = tmp_path / f"optimized-{len(disabled)}.onnx"
        emb.open_session(entry / "model.onnx", 1, optimized_to=optimized, disabled=disabled)
        return {node.op_type for node in onnx.load(str(optimized), load_external_data=False).graph.node}

    assert "SkipLayerNormalization" in ops(())
    assert "SkipLayerNormalization" not in ops(emb.ORT_DISABLED_OPTIMIZERS)


def test_two_loads_at_once_on_a_fresh_cache_export_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers starting together on a host: the second waits for the first one's export and opens it."""
    monkeypatch.setenv("KINFER_HOME", str(tmp_path))
    monkeypatch.delenv("KINFER_CACHE", raising=False)
    exports: list[Path] = []
    export = emb.EmbeddingRunner._export

    def counted(self: Any, entry: Path) -> None:
        exports.append(entry)
        export(self, entry)

    monkeypatch.setattr(emb.EmbeddingRunner, "_export", counted)
    with ThreadPoolExecutor(2) as pool:
        runners = list(pool.map(lambda _: embed("onnx"), range(2)))
    assert len(exports) == 1
    assert all(r.runtime == "onnx" for r in runners) and sorted(r.onnx_exported for r in runners) == [False, True]
    assert np.allclose(runners[0].run(TEXTS), runners[1].run(TEXTS), atol=1e-6)


def test_disagreement_falls_back_to_torch(
    exported: Any, reference: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(emb, "ONNX_MIN_COSINE", 1.5)  # nothing can pass: the self-check must refuse ONNX
    with caplog.at_level(logging.WARNING, logger=emb.__name__):
        runner = embed("onnx")
    assert runner.runtime == "torch"
    assert any("disagree with torch" in r.getMessage() for r in caplog.records)
    assert np.allclose(runner.run(TEXTS), reference.run(TEXTS), atol=1e-6)


def test_runtime_option() -> None:
    with pytest.raises(ValueError, match="runtime must be one of"):
        build_runner(resolve_model("minilm", options={"runtime": "tensorrt"}), device="cpu")
    with pytest.raises(ValueError, match="CPU only"):
        build_runner(resolve_model("minilm", options={"runtime": "onnx"}), device="cuda")
    # One --runtime for every model of a worker: torch-only families accept auto/torch and refuse onnx.
    assert build_runner(resolve_model("noop", options={"runtime": "auto"})).family == "noop"
    with pytest.raises(ValueError, match="embedding family only"):
        build_runner(resolve_model("noop", options={"runtime": "onnx"}))
    with pytest.raises(ValueError, match="'onnx-int8' serves the embedding family only"):
        build_runner(resolve_model("noop", options={"runtime": "onnx-int8"}))
    with pytest.raises(ValueError, match="CPU only"):
        build_runner(resolve_model("minilm", options={"runtime": "onnx-int8"}), device="cuda")


def test_a_swap_in_from_disk_reopens_the_checked_export_without_torch_weights(
    exported: Any, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked once in this process, the unchanged export is reopened alone: no torch model, no check."""
    def no_torch_weights(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a swap-in loaded torch's weights again")

    exported.unload()
    monkeypatch.setattr(emb.AutoModel, "from_pretrained", no_torch_weights)
    exported.load()
    assert exported.runtime == "onnx" and exported.footprint_bytes() > 50 * (1 << 20)  # the weights, not the graph
    assert min(cosines(exported.run(TEXTS), reference.run(TEXTS))) >= emb.ONNX_MIN_COSINE


def test_int8_is_made_once_from_the_export_and_stays_near_torch(
    exported: Any, reference: Any, home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``onnx-int8``: the export's weights quantized once beside it; its vectors within the int8 bar of
    torch's, unit length, the graph a quarter of the float one; a second load (no check this process
    remembers) reuses it, and a graph that misses its bar falls back to torch."""
    (entry,) = (home / "onnx").iterdir()
    int8 = embed("onnx-int8")
    assert int8.runtime == "onnx-int8" and not int8.onnx_exported  # made from the export the fixture wrote
    graph = entry / emb.ONNX_GRAPHS["onnx-int8"]
    assert graph.is_file() and sorted(p.name for p in entry.iterdir() if p.name.startswith(".")) == []
    near = cosines(int8.run(TEXTS), reference.run(TEXTS))
    alone = cosines([int8.run([t])[0] for t in TEXTS], [reference.run([t])[0] for t in TEXTS])
    assert (near >= emb.ONNX_INT8_MIN_COSINE).all() and (alone >= emb.ONNX_INT8_MIN_COSINE).all(), (near, alone)
    assert np.allclose(np.linalg.norm(int8.run(TEXTS), axis=1), 1.0, atol=1e-5)
    assert int8.footprint_bytes() < exported.footprint_bytes() / 3

    def no_quantizing(*args: Any) -> None:
        raise AssertionError("quantized a second time")

    mtime = graph.stat().st_mtime_ns
    monkeypatch.setattr(emb, "quantize_int8", no_quantizing)
    monkeypatch.setattr(emb, "_CHECKED", {})
    again = embed("onnx-int8")
    assert again.runtime == "onnx-int8" and graph.stat().st_mtime_ns == mtime
    assert np.allclose(again.run(TEXTS), int8.run(TEXTS), atol=1e-6)

    monkeypatch.setattr(emb, "ONNX_INT8_MIN_COSINE", 1.5)
    monkeypatch.setattr(emb, "_CHECKED", {})
    with caplog.at_level(logging.WARNING, logger=emb.__name__):
        refused = embed("onnx-int8")
    assert refused.runtime == "torch"
    assert any("onnx-int8 outputs disagree with torch" in r.getMessage() for r in caplog.records)
