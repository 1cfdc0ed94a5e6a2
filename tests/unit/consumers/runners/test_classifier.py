"""The classification runner against a direct call of the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from kinfer.consumers.runners import build_runner, resolve_model
from kinfer.consumers.runners.tinylm import build_tiny_classifier

pytestmark = pytest.mark.models  # builds or loads real models (tens of seconds): not in `make check`


def test_labels_and_scores_match_the_model(tmp_path: Path) -> None:
    path = build_tiny_classifier(tmp_path / "clf")
    runner = build_runner(resolve_model("sentiment", "classifier", str(path)))
    runner.load()
    texts = ["a fine day", "kafka partitions and consumer groups, at some length this time"]
    got = runner.run(texts)  # type: ignore[attr-defined]

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        for text, out in zip(texts, got, strict=True):
            probs = torch.softmax(model(**tok(text, return_tensors="pt")).logits[0], -1)
            best = int(probs.argmax())
            assert out["label"] == model.config.id2label[best]
            assert out["score"] == pytest.approx(float(probs[best]), abs=1e-5)
            assert out["labels"][0]["label"] == out["label"]
            assert sum(x["score"] for x in out["labels"]) == pytest.approx(1.0, abs=1e-5)


def test_token_counts_are_the_tokenizers(tmp_path: Path) -> None:
    """Usage counts tokens, not words: each text's attention mask, special tokens and truncation included."""
    path = build_tiny_classifier(tmp_path / "clf")
    runner = build_runner(resolve_model("sentiment", "classifier", str(path)))
    runner.load()
    texts = ["a fine day", "kafka partitions and consumer groups, at some length this time"]
    outputs, counts = runner.run_counted(texts)  # type: ignore[attr-defined]
    tok = AutoTokenizer.from_pretrained(path)
    assert counts == [len(tok(t)["input_ids"]) for t in texts]
    assert outputs == runner.run(texts)  # type: ignore[attr-defined]
