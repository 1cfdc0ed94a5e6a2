"""Generation from any Hugging Face causal LM, one token per step, for continuous batching.

The running batch is a value, ``GenBatch`` (after TGI's ``CausalLMBatch``): rows are sequences,
each with its KV cache, left-padded to a common length. ``filter(ids)`` drops rows that finished
or were cancelled (and trims cache columns that only padding still uses); ``concatenate(batches)``
merges newly prefilled rows into the running batch. Continuous batching is exactly these two
operations around one forward pass per step.

Each step picks every row's next token at once on the device (``devsample``: one host copy per step)
and turns each row's new token into text with an ``IncrementalDecoder`` (``detok``: a short window per
token, never the whole output again).

Two engines keep the KV caches. ``dynamic`` (the default on a CPU) is the value above: shapes follow the
rows, so it allocates no more than they use. ``slots`` (the default on a GPU) is ``SlotEngine``: a fixed
block of KV slots, a decode step per batch-size bucket captured as a CUDA graph, long prompts prefilled a
chunk at a time between decode steps; a sequence's prompt and output together fit its slot's ``context``
tokens, and an output that fills it ends with finish ``length``.

Everything here runs in the worker's executor thread; nothing touches the event loop.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kinfer.consumers.runners.base import TorchResidency, choose_attention, drop_weights
from kinfer.consumers.runners.detok import IncrementalDecoder, TextRules
from kinfer.consumers.runners.devsample import pick_tokens
from kinfer.consumers.runners.sampling import GenInput, Sampling, TokenEvent
from kinfer.consumers.runners.slotengine import PREFILL_ROWS, SlotBatch, SlotEngine

__all__ = ["MAX_STRIP_PASSES", "PLAIN_CHAT_STOPS", "PLAIN_CHAT_TAGS", "PLAIN_CHAT_TEMPLATE", "GenBatch", "GenInput",
           "GeneratorRunner", "Sampling", "TokenEvent"]

# For a model whose tokenizer has no chat template of its own: each turn tagged with its role, then the
# assistant's tag to answer after. The turn tags are stop sequences (``PLAIN_CHAT_STOPS``), so an answer
# never runs on into an invented next turn. A model's own template relies on its end-of-turn token.
PLAIN_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PLAIN_CHAT_STOPS = ("<|user|>", "<|system|>")
PLAIN_CHAT_TAGS = ("<|system|>", "<|user|>", "<|assistant|>")  # the plain template's role tags
# A turn loses the tokenizer's special tokens and the role tags until none is left; each pass removes
# one layer of nesting (``<|im_<|im_end|>end|>``). Deeper than this, the turn is refused, not stripped.
MAX_STRIP_PASSES = 8


@dataclass
class _Row:
    id: str
    prompt: list[int]  # prompt token ids (speculation looks for n-grams here)
    sampling: Sampling
    generator: torch.Generator | None  # the row's own draws (None: greedy)
    text: IncrementalDecoder  # the output's text as it becomes final
    tokens: list[int] = field(default_factory=list)
    unsent: str = ""  # final text held back: it could still become a stop sequence
    sent_tail: str = ""  # the last characters sent, as long as the longest stop (one may span the boundary)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


@dataclass
class GenBatch:
    """Left-padded running batch: ``cache`` holds every token fed so far, ``next_ids`` the ones to feed."""

    ids: list[str]
    cache: Any  # a DynamicCache: per layer, keys/values [rows, heads, T, head_dim]
    attention_mask: torch.Tensor  # [rows, T]: 1 where the cache holds a real token
    next_ids: torch.Tensor  # [rows]: last sampled token of each row, not yet fed
    positions: torch.Tensor  # [rows]: position id of next_ids (= real tokens so far)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def cache_tokens(self) -> int:
        """Cache slots allocated (rows × length), padding included."""
        return int(self.attention_mask.numel())

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum().item())

    def filter(self, keep: list[str]) -> GenBatch | None:
        if not keep:
            return None
        if keep == self.ids:
            return self
        index = torch.tensor([self.ids.index(i) for i in keep], device=self.next_ids.device)
        mask = self.attention_mask.index_select(0, index)
        # Columns that every remaining row has as padding can go: their memory is freed now.
        first = int(mask.any(dim=0).int().argmax().item())
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        return GenBatch(
            list(keep), self.cache, mask[:, first:], self.next_ids.index_select(0, index),
            self.positions.index_select(0, index),
        )

    @staticmethod
    def concatenate(batches: list[GenBatch]) -> GenBatch:
        if len(batches) == 1:
            return batches[0]
        length = max(b.attention_mask.shape[1] for b in batches)
        first = batches[0]
        for li, layer in enumerate(first.cache.layers):
            keys, values = [], []
            for b in batches:
                k, v = b.cache.layers[li].keys, b.cache.layers[li].values
                assert k is not None and v is not None
                pad = length - k.shape[2]
                keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            layer.keys, layer.values = torch.cat(keys), torch.cat(values)
        masks = [torch.nn.functional.pad(b.attention_mask, (length - b.attention_mask.shape[1], 0)) for b in batches]
        return GenBatch(
            [i for b in batches for i in b.ids], first.cache, torch.cat(masks),
            torch.cat([b.next_ids for b in batches]), torch.cat([b.positions for b in batches]),
        )


class GeneratorRunner(TorchResidency):
    family = "generator"

    def __init__(self, path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
                 max_prompt_tokens: int = 1024, speculate: int = 0, ngram: int = 3, engine: str = "auto",
                 slots: int = 64, context: int | None = None, prefill_chunk: int = 512, graphs: bool = True) -> None:
        self.path = str(path)
        self.device = device
        self.dtype = dtype or (torch.float16 if device.startswith("cuda") else torch.float32)
        if engine == "auto":
            engine = "slots" if device.startswith("cuda") else "dynamic"
        if engine not in ("dynamic", "slots"):
            raise ValueError(f"engine must be 'auto', 'dynamic' or 'slots', got {engine!r}")
        # The slot engine's context: as given, else 2,048 tokens or the model's positions if fewer.
        limit = _positions(self.path)
        if context is None:
            context = min(DEFAULT_CONTEXT, limit or DEFAULT_CONTEXT)
        elif limit is not None and context > limit and engine == "slots":
            raise ValueError(f"context {context} exceeds the model's {limit} positions")
        for name, value, least in (("slots", slots, 1), ("context", context, 2), ("prefill_chunk", prefill_chunk, 1)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.engine = engine
        self.slots, self.context, self.prefill_chunk, self.graphs = slots, context, prefill_chunk, bool(graphs)
        # With slots, a prompt leaves its slot at least one column for the first token it samples.
        self.max_prompt_tokens = min(max_prompt_tokens, context - 1) if engine == "slots" else max_prompt_tokens
        # Sequences the runner can hold at once (the scheduler runs no more): its slots, else no bound.
        self.max_rows: int | None = slots if engine == "slots" else None
        self.max_sequence_tokens: int | None = context if engine == "slots" else None
        # Prompt-lookup speculative decoding: up to ``speculate`` draft tokens copied from an earlier
        # occurrence of the last ``ngram`` tokens, verified in one forward pass. 0 turns it off.
        self.speculate = int(speculate)
        self.ngram = int(ngram)
        self.spec_proposed = 0  # draft tokens offered for verification
        self.spec_accepted = 0  # of which the model agreed with
        self.tokenizer: Any = None
        self.model: Any = None
        self.eos: set[int] = set()
        self._specials: re.Pattern[str] | None = None  # the tokenizer's special-token strings, out of chat turns
        self._text_rules: TextRules | None = None  # how the tokenizer decodes, for each row's IncrementalDecoder
        self._batch: GenBatch | None = None  # the dynamic engine's running batch
        self._slot_batch: SlotBatch | None = None  # the slot engine's, as the core reads it
        self._rows: dict[str, _Row] = {}
        self._slots: SlotEngine | None = None
        self._prefilling: list[str] = []  # slot engine: rows whose prompt is not all in their slot yet, oldest first

    # -- lifecycle ---------------------------------------------------------------------------

    def load(self) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        choose_attention(self.device)  # the KV length is new at every step: never a per-shape plan
        model: Any = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        # transformers 5.x renamed ``past_key_values`` to ``cache``; the cache is updated in place.
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        added = getattr(self.tokenizer, "added_tokens_decoder", {}).values()
        specials = {*self.tokenizer.all_special_tokens, *(t.content for t in added if getattr(t, "special", False)),
                    *PLAIN_CHAT_TAGS}
        self._specials = re.compile(_trie_pattern(t for t in specials if t))
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
        self._text_rules = TextRules.of(self.tokenizer)
        self._make_slots()

    def _make_slots(self) -> None:
        if self.engine == "slots" and self._slots is None and self.model is not None:
            self._slots = SlotEngine(self.model, self.slots, self.context, self.device, self.dtype, self.graphs)

    def _weights(self) -> Any:
        return self.model

    def footprint_bytes(self) -> int:
        """The weights, and the slot engine's KV block (allocated at warm-up): both hold the device."""
        return super().footprint_bytes() + (self._slots.cache.nbytes if self._slots is not None else 0)

    def offload(self) -> None:
        """Weights to host RAM; on a GPU the KV block is given back (the next warm-up makes it again)."""
        if self._slots is not None and self.device != "cpu":
            self._slots = None
        super().offload()

    def restore(self) -> None:
        super().restore()
        self._make_slots()

    def unload(self) -> None:
        if self.batch is not None:
            raise RuntimeError("unload with sequences running: the worker drains a model before it swaps it out")
        self.model = None
        self._slots = None  # its KV block goes with the weights
        drop_weights(self.device)

    def reset(self) -> None:
        """Forget the running batch and every row (after a failed step left them in an unknown state)."""
        self._batch = self._slot_batch = None
        self._rows.clear()
        self._prefilling.clear()
        if self._slots is not None:
            self._slots.reset()

    def warmup(self) -> None:
        if self._slots is not None:
            self._slots.warm()  # every bucket's decode step, captured where graphs are
        self.step([GenInput("warmup", "warm up the kernels", Sampling(max_new_tokens=2))], [])
        while self.batch is not None:
            self.step([], [])

    def render_chat(self, turns: list[tuple[str, str]]) -> tuple[str, tuple[str, ...]]:
        """The model's own chat template when its tokenizer has one, else ``PLAIN_CHAT_TEMPLATE``
        (Jinja in transformers' sandbox, rendered on the event loop: no tokenizing, no torch).

        The rendered text is tokenized with its special tokens recognised (the template places them),
        so a turn's own text may not carry them: they are removed from every content first — else a
        user could end their turn and forge a system one (``<|im_end|><|im_start|>system``). So are
        the plain template's role tags (``<|system|>``: plain text to the tokenizer, a turn to the model).
        Removal runs to a fixed point, so halves around a removed token cannot join into a new one; a
        turn nesting them deeper than ``MAX_STRIP_PASSES`` is refused (``ValueError``): stripping it
        would cost a pass per layer, and no honest text nests special tokens.
        """
        template = getattr(self.tokenizer, "chat_template", None)
        messages = [{"role": role, "content": self._unspecial(content)} for role, content in turns]
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True,
                **({} if template else {"chat_template": PLAIN_CHAT_TEMPLATE}),
            )
        except jinja2.TemplateError as exc:  # raise_exception() in a template: it refuses these turns
            raise ValueError(f"the model's chat template refused the messages: {exc}") from exc
        plain = not template or template == PLAIN_CHAT_TEMPLATE  # the built-in tiny-lm ships it as its own
        return str(prompt), (PLAIN_CHAT_STOPS if plain else ())

    def _unspecial(self, text: str) -> str:
        """``text`` without special tokens or role tags, to a fixed point: a removal that joins two halves
        into a new one removes that one too. ``ValueError`` past ``MAX_STRIP_PASSES`` layers of nesting."""
        if self._specials is None:
            return text
        for _ in range(MAX_STRIP_PASSES):
            text, removed = self._specials.subn("", text)
            if not removed:
                return text
        if self._specials.search(text) is None:
            return text
        raise ValueError(f"a turn nests special tokens or role tags more than {MAX_STRIP_PASSES} deep")

    def count_tokens(self, text: str) -> int:
        return min(self.max_prompt_tokens, len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + 1)

    @property
    def batch(self) -> GenBatch | SlotBatch | None:
        """The running batch (its ids, and KV columns allocated against used), or None when empty."""
        return self._slot_batch if self._slots is not None else self._batch

    @property
    def running(self) -> list[str]:
        batch = self.batch
        return list(batch.ids) if batch is not None else []

    # -- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, admit: list[GenInput], drop: list[str]) -> list[TokenEvent]:
        """Drop rows, decode one token for every running row, prefill the admitted ones."""
        if self._slots is not None:
            return self._slot_step(self._slots, admit, drop)
        if drop and self._batch is not None:
            self._batch = self._batch.filter([i for i in self._batch.ids if i not in set(drop)])
        for i in drop:
            self._rows.pop(i, None)
        events: list[TokenEvent] = []
        if self._batch is not None:
            drafts = self._propose(self._batch) if self.speculate and not admit else []
            events += self._verify(self._batch, drafts) if drafts else self._decode(self._batch)
        if admit:
            new = self._prefill(admit)
            events += self._sample(new, self._last_logits)
            self._batch = new if self._batch is None else GenBatch.concatenate([self._batch, new])
        done = {e.id for e in events if e.finish is not None}
        if done and self._batch is not None:
            self._batch = self._batch.filter([i for i in self._batch.ids if i not in done])
            for i in done:
                self._rows.pop(i, None)
        return events

    def _prefill(self, admit: list[GenInput]) -> GenBatch:
        encoded = [self._enter(a).prompt for a in admit]
        length = max(len(e) for e in encoded)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (length - len(e)) + e for e in encoded], device=self.device)
        mask = torch.tensor([[0] * (length - len(e)) + [1] * len(e) for e in encoded], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self._cache_kw: cache})
        self._last_logits = out.logits[:, -1, :]
        lengths = mask.sum(-1)
        return GenBatch([a.id for a in admit], cache, mask, lengths.clone(), lengths.clone())

    def _enter(self, a: GenInput) -> _Row:
        """A new sequence's row: its prompt tokenized (as rendered when templated) and cut to the last
        ``max_prompt_tokens``; even an empty prompt keeps one token, a position to start from."""
        prompt = self.tokenizer(a.prompt, add_special_tokens=not a.templated)["input_ids"][-self.max_prompt_tokens:]
        prompt = prompt or [self.tokenizer.pad_token_id or 0]
        text = IncrementalDecoder(self.tokenizer, self.eos, self._text_rules)
        row = self._rows[a.id] = _Row(a.id, prompt, a.sampling, _generator(a.id, a.sampling), text)
        return row

    def _decode(self, batch: GenBatch) -> list[TokenEvent]:
        mask = torch.nn.functional.pad(batch.attention_mask, (0, 1), value=1)
        out = self.model(
            input_ids=batch.next_ids[:, None], attention_mask=mask, position_ids=batch.positions[:, None],
            use_cache=True, **{self._cache_kw: batch.cache},
        )
        batch.attention_mask = mask
        batch.positions = batch.positions + 1
        return self._sample(batch, out.logits[:, -1, :])

    def _propose(self, batch: GenBatch) -> list[int]:
        """Draft tokens for a lone greedy sequence: what followed the last n-gram before.

        Speculation pays when the batch is nearly empty (the device has compute to spare, as at
        low load) and outputs repeat their input (code edits, extraction, summaries that quote).
        With several rows, the batch itself already fills the device, so it is not tried.
        """
        return self._drafts(self._rows[batch.ids[0]]) if len(batch) == 1 else []

    def _drafts(self, row: _Row, room: int | None = None) -> list[int]:
        """Up to ``speculate`` drafts for a greedy row, leaving its last token to the model, and no more
        than ``room`` (columns its slot has left past the pending token)."""
        most = min(self.speculate, row.sampling.max_new_tokens - len(row.tokens) - 1)
        if room is not None:
            most = min(most, room - 1)
        if row.sampling.temperature != 0 or most < 1:
            return []
        return _lookup(row.prompt + row.tokens, self.ngram, most)

    def _verify(self, batch: GenBatch, drafts: list[int]) -> list[TokenEvent]:
        """Feed the pending token and the drafts at once; keep the drafts the model agrees with."""
        fed = torch.tensor([[int(batch.next_ids[0]), *drafts]], device=self.device)
        length = batch.attention_mask.shape[1]
        mask = torch.nn.functional.pad(batch.attention_mask, (0, fed.shape[1]), value=1)
        positions = batch.positions[:, None] + torch.arange(fed.shape[1], device=self.device)
        out = self.model(input_ids=fed, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self._cache_kw: batch.cache})
        greedy = out.logits[0].argmax(-1).tolist()  # greedy[j]: the model's token after fed[j]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
            accepted += 1
        self.spec_proposed += len(drafts)
        self.spec_accepted += accepted
        keep = length + 1 + accepted  # the pending token and the accepted drafts stay in the cache
        for layer in batch.cache.layers:  # rejected drafts leave the cache
            layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
        batch.attention_mask = mask[:, :keep]
        batch.positions = batch.positions + 1 + accepted
        row = self._rows[batch.ids[0]]
        events = []
        for token in [*drafts[:accepted], greedy[accepted]]:
            row.tokens.append(token)
            events.append(self._event(row, token))
            if events[-1].finish is not None:
                break
        batch.next_ids = torch.tensor([events[-1].token], device=self.device)
        return events

    def _sample(self, batch: GenBatch, logits: torch.Tensor) -> list[TokenEvent]:
        """Every row's next token in one pass on the device; the one copy to the host is ``tolist``."""
        rows = [self._rows[rid] for rid in batch.ids]
        picked = pick_tokens(logits, [(row.sampling, row.generator) for row in rows])
        batch.next_ids = picked  # already on the device: the next step feeds it as it is
        events = []
        for row, token in zip(rows, picked.tolist(), strict=True):
            row.tokens.append(token)
            events.append(self._event(row, token))
        return events

    # -- the slot engine ---------------------------------------------------------------------

    def _slot_step(self, engine: SlotEngine, admit: list[GenInput], drop: list[str]) -> list[TokenEvent]:
        """Drop rows; one decode step for every row whose prompt is in its slot; the admitted rows take
        slots; then up to ``prefill_chunk`` prompt tokens go in, oldest prompt first."""
        for rid in drop:
            self._leave(engine, rid)
        table = engine.table
        decoding = [rid for rid in table.ids if table.prefilled(rid)]
        events: list[TokenEvent] = []
        if decoding:
            drafts = self._propose_slot(engine, decoding) if self.speculate and not admit else []
            events += self._verify_slot(engine, decoding[0], drafts) if drafts else self._decode_slots(engine, decoding)
        for a in admit:
            table.admit(a.id, len(self._enter(a).prompt))
            self._prefilling.append(a.id)
        events += self._prefill_slots(engine)
        for e in events:
            if e.finish is not None:
                self._leave(engine, e.id)
        self._slot_batch = SlotBatch(table) if len(table) else None
        return events

    def _leave(self, engine: SlotEngine, rid: str) -> None:
        if rid in engine.table:
            engine.release(rid)
        self._rows.pop(rid, None)
        if rid in self._prefilling:
            self._prefilling.remove(rid)

    def _decode_slots(self, engine: SlotEngine, decoding: list[str]) -> list[TokenEvent]:
        table = engine.table
        rows = [self._rows[rid] for rid in decoding]
        slots = [table.slot(rid) for rid in decoding]
        logits = engine.decode({slot: row.tokens[-1] for slot, row in zip(slots, rows, strict=True)})
        if slots != list(range(len(slots))):  # rows still prefilling sit between them
            logits = logits.index_select(0, torch.tensor(slots, device=logits.device))
        else:
            logits = logits[: len(slots)]
        picked = pick_tokens(logits, [(row.sampling, row.generator) for row in rows]).tolist()
        events = []
        for rid, row, token in zip(decoding, rows, picked, strict=True):
            table.grow(rid, 1)  # the token it fed
            row.tokens.append(token)
            events.append(self._event(row, token, full=table.room(rid) == 0))
        return events

    def _prefill_slots(self, engine: SlotEngine) -> list[TokenEvent]:
        """Up to ``prefill_chunk`` prompt tokens: whole prompts not started yet go in one forward pass
        together; a prompt that does not fit what is left of the chunk goes in alone, as much as fits."""
        table = engine.table
        budget = self.prefill_chunk
        whole: list[str] = []
        done: list[tuple[str, torch.Tensor]] = []
        for rid in list(self._prefilling):
            if budget <= 0:
                break
            left = table.remaining_prompt(rid)
            if table.length(rid) == 0 and left <= budget:
                whole.append(rid)
                budget -= left
                continue
            start, n = table.length(rid), min(left, budget)
            logits = engine.prefill([table.slot(rid)], [self._rows[rid].prompt[start : start + n]], start)
            table.grow(rid, n)
            budget -= n
            if table.prefilled(rid):
                done.append((rid, logits[0]))
        for first in range(0, len(whole), PREFILL_ROWS):
            group = whole[first : first + PREFILL_ROWS]
            prompts = [self._rows[rid].prompt for rid in group]
            logits = engine.prefill([table.slot(rid) for rid in group], prompts, 0)
            for i, (rid, prompt) in enumerate(zip(group, prompts, strict=True)):
                table.grow(rid, len(prompt))
                done.append((rid, logits[i]))
        if not done:
            return []
        for rid, _ in done:
            self._prefilling.remove(rid)
        rows = [self._rows[rid] for rid, _ in done]
        picked = pick_tokens(torch.stack([lg for _, lg in done]), [(r.sampling, r.generator) for r in rows]).tolist()
        events = []
        for row, token in zip(rows, picked, strict=True):
            row.tokens.append(token)
            events.append(self._event(row, token))
        return events

    def _propose_slot(self, engine: SlotEngine, decoding: list[str]) -> list[int]:
        """Drafts for a lone greedy row with no prompt waiting, as many as its slot has room for."""
        if len(decoding) != 1 or self._prefilling:
            return []
        return self._drafts(self._rows[decoding[0]], room=engine.table.room(decoding[0]) - 1)  # less the pending token

    def _verify_slot(self, engine: SlotEngine, rid: str, drafts: list[int]) -> list[TokenEvent]:
        """Feed the pending token and the drafts at once; keep the drafts the model agrees with (the
        rejected ones' columns are written over later)."""
        table = engine.table
        row = self._rows[rid]
        fed = [row.tokens[-1], *drafts]
        logits = engine.prefill([table.slot(rid)], [fed], table.length(rid), every=True)
        greedy = logits[0].argmax(-1).tolist()  # greedy[j]: the model's token after fed[j]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
            accepted += 1
        self.spec_proposed += len(drafts)
        self.spec_accepted += accepted
        table.grow(rid, 1 + accepted)
        events = []
        for token in [*drafts[:accepted], greedy[accepted]]:
            row.tokens.append(token)
            events.append(self._event(row, token, full=table.room(rid) == 0))
            if events[-1].finish is not None:
                break
        return events

    def _event(self, row: _Row, token: int, full: bool = False) -> TokenEvent:
        """The text ``token`` makes final, less a stop sequence (cut, with what follows) and less what could
        still become one (held back); at the end, everything left. ``full``: the row's KV slot has no
        column left to feed ``token``, so the output ends here (``length``)."""
        finish = None
        if token in self.eos:
            finish = "eos"
        elif len(row.tokens) >= row.sampling.max_new_tokens or full:
            finish = "length"
        fresh = row.text.push(token)  # an EOS token is skipped: it adds no text
        if finish is not None:
            fresh += row.text.finish()
        stops = row.sampling.stop
        if not stops:
            return TokenEvent(row.id, token, fresh, finish, row.prompt_tokens, len(row.tokens))
        text = row.sent_tail + row.unsent + fresh  # the tail of the output: what is unsent, and enough before
        sent = len(row.sent_tail)
        cut = min((i for s in stops if (i := text.find(s, max(0, sent - len(s)))) >= 0), default=-1)
        if cut >= 0:
            finish, end = "stop", cut
        elif finish is None:
            end = len(text) - _held_back(text, stops)
        else:
            end = len(text)
        delta = text[sent:end]
        row.unsent = text[max(sent, end):]
        row.sent_tail = (row.sent_tail + delta)[-max(len(s) for s in stops):]
        return TokenEvent(row.id, token, delta, finish, row.prompt_tokens, len(row.tokens))


DEFAULT_CONTEXT = 2_048  # the slot engine's context when neither the option nor the model says less


def _positions(path: str) -> int | None:
    """The positions a model's config allows (``max_position_embeddings``, GPT-2's ``n_positions``), read
    from its ``config.json`` without loading anything; None when it does not say."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and value > 1:
            return value
    return None


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching any of ``words``, longest first, factored by common prefix: one pass over a text
    costs about its length, not its length times the number of words (Llama 3 has 256 special tokens)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def build(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer word when both match

    return build(trie)


def _lookup(history: list[int], ngram: int, most: int) -> list[int]:
    """Up to ``most`` tokens that followed the latest earlier occurrence of the longest tail n-gram
    (n from ``ngram`` down to 1) of ``history``: prompt lookup's draft."""
    for n in range(min(ngram, len(history) - 1), 0, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == tail:
                drafts = history[start + n : start + n + most]
                if drafts:
                    return drafts
    return []


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could still become a stop sequence: not sent yet."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if s.startswith(text[-k:]):
                best = max(best, k)
                break
    return best


def _generator(request_id: str, sampling: Sampling) -> torch.Generator | None:
    if sampling.temperature == 0:
        return None
    seed = sampling.seed
    if seed is None:
        seed = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    return torch.Generator().manual_seed(seed % (2**63))
