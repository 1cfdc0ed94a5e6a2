"""Sentence embeddings from any Hugging Face encoder: mean pooling over real tokens, L2-normalised.

That is the recipe all-MiniLM-L6-v2 was trained with (its ``1_Pooling`` config says mean pooling,
``modules.json`` adds ``Normalize``), so the vectors match sentence-transformers' own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel, AutoTokenizer

from consumers.runners.base import encode, estimate_tokens


class EmbeddingRunner:
    family = "embedding"

    def __init__(self, path: str | Path, device: str = "cpu", max_length: int = 256) -> None:
        self.path = str(path)
        self.device = device
        self.max_length = max_length  # all-MiniLM-L6-v2 was trained on 256-token windows
        # fp16 halves memory traffic on a GPU; CPUs have no fast fp16 matmul, so they stay fp32.
        self.dtype = torch.float16 if device.startswith("cuda") else torch.float32
        self._tokenizer: Any = None
        self._model: Any = None

    def load(self) -> None:
        self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        self._model = AutoModel.from_pretrained(self.path, dtype=self.dtype).to(self.device).eval()

    def warmup(self) -> None:
        for n, words in ((1, 4), (8, 32), (32, 64)):
            self.run([" ".join(["warmup"] * words)] * n)

    def count_tokens(self, text: str) -> int:
        return estimate_tokens(text, self.max_length)

    @torch.inference_mode()
    def run(self, texts: list[str]) -> list[Any]:
        enc = encode(self._tokenizer, texts, self.max_length, self.device)
        hidden = self._model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        normed = torch.nn.functional.normalize(pooled.float(), p=2, dim=1)
        vectors: list[Any] = normed.cpu().tolist()
        return vectors
