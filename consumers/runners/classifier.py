"""Sequence classification from any Hugging Face directory: labels and scores per input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from kinfer.consumers.runners.base import TorchResidency, choose_attention, drop_weights, estimate_tokens, to_device
from kinfer.consumers.runners.tokenize import BatchTokenizer


class ClassifierRunner(TorchResidency):
    family = "classifier"

    def __init__(self, path: str | Path, device: str = "cpu", max_length: int = 256, top_k: int = 5) -> None:
        self.path = str(path)
        self.device = device
        self.max_length = int(max_length)
        self.top_k = int(top_k)  # labels returned per input, best first
        self.dtype = torch.float16 if device.startswith("cuda") else torch.float32
        self._encoder: BatchTokenizer | None = None  # from load(): the Rust batch encoder, shared by every thread
        self._model: Any = None
        self._labels: dict[int, str] = {}

    def load(self) -> None:
        self._encoder = BatchTokenizer(AutoTokenizer.from_pretrained(self.path), self.max_length)
        choose_attention(self.device)
        model: Any = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=self.dtype)
        self._model = model.to(self.device).eval()
        self._labels = {int(i): str(name) for i, name in self._model.config.id2label.items()}

    def warmup(self) -> None:
        self.run(["warm up"] * 4)

    def _weights(self) -> Any:
        return self._model

    def unload(self) -> None:
        self._model = None
        drop_weights(self.device)

    def count_tokens(self, text: str) -> int:
        return estimate_tokens(text, self.max_length)

    def run(self, texts: list[str]) -> list[Any]:
        return self.run_counted(texts)[0]

    @torch.inference_mode()
    def run_counted(self, texts: list[str]) -> tuple[list[Any], list[int]]:
        """The labels, and the tokens each text became (special tokens and truncation included)."""
        assert self._encoder is not None
        enc = self._encoder.encode(texts)
        inputs = to_device(enc.arrays(self._encoder.input_names), self.device)
        probs = torch.softmax(self._model(**inputs).logits.float(), dim=-1).cpu()
        k = min(self.top_k, probs.shape[-1])
        top = probs.topk(k, dim=-1)
        outputs = [
            {
                "label": self._labels[int(idx[0])],
                "score": float(val[0]),
                "labels": [{"label": self._labels[int(i)], "score": float(v)} for v, i in zip(val, idx, strict=True)],
            }
            for val, idx in zip(top.values, top.indices, strict=True)
        ]
        return outputs, enc.lengths.tolist()
