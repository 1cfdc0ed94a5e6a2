"""Token ids to text as they are generated, decoding a short window per token (after TGI's ``decode_token``).

Decoding a sequence's whole output at every step costs its length each time: quadratic over a long answer.
``IncrementalDecoder`` keeps two offsets into the tokens instead: text before ``read`` is final, and the
tokens from ``prefix`` to ``read`` are context. Each token decodes ``tokens[prefix:]`` and
``tokens[prefix:read]``; what the first has past the second is the new text. The context makes the new
tokens decode as they would inside the whole sequence, not as its first token (WordPiece writes no space
before the first token and keeps its ``##``; SentencePiece strips the first space).

Text is final only when no later token can change it, so some is held back:

- a decoded window that ends in U+FFFD: the newest bytes may be the first of a multi-byte character;
- a run of byte-fallback tokens (``<0xE2>``): a later byte can turn the whole run into U+FFFD, so a run
  is read once a token that is not a byte closes it;
- when the tokenizer cleans up spaces (``clean_up_tokenization_spaces``: `` .`` becomes ``.``, `` ' `` and
  `` n't`` join their neighbours), text whose last three characters hold a space: every cleanup pattern
  starts with a space and is at most four characters long, so it can never reach back past three
  non-space characters.

``finish()`` ends the sequence: it decodes the whole output once and returns whatever was held back, so
everything a sequence produced is exactly ``tokenizer.decode(tokens, skip_special_tokens=True)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["CLEANUP_REACH", "IncrementalDecoder", "TextRules"]

CLEANUP_REACH = 3  # characters a cleanup pattern can change before the text that completes it
_PROBE = "a . b , c ? d ! e ' f"  # text whose tokens decode to the patterns cleanup removes spaces from


@dataclass(frozen=True, slots=True)
class TextRules:
    """What a tokenizer's decoding does that incremental decoding must know: found once per tokenizer."""

    special: frozenset[int]  # ids decoding drops with skip_special_tokens
    byte_ids: frozenset[int]  # byte-fallback tokens (``<0x00>`` .. ``<0xFF>``)
    cleans: bool  # whether ``decode`` cleans up tokenization spaces

    @classmethod
    def of(cls, tokenizer: Any) -> TextRules:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = frozenset(int(i) for i, t in added.items() if getattr(t, "special", False))
        names = [f"<0x{b:02X}>" for b in range(256)]
        names += [n.lower() for n in names if n != n.lower()]  # decoders read either case
        ids = tokenizer.convert_tokens_to_ids(names)
        unk = getattr(tokenizer, "unk_token_id", None)
        byte_ids = frozenset(int(i) for i in ids if i is not None and i != unk) - special
        return cls(special, byte_ids, _cleans_up(tokenizer))


def _cleans_up(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` applies ``clean_up_tokenization`` (transformers skips it for BPE models
    even when asked): seen on a probe when the probe shows it, else the tokenizer's own setting."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    raw = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if tokenizer.clean_up_tokenization(raw) == raw:  # nothing to clean in it: the probe cannot tell
        return True
    return bool(tokenizer.decode(ids, skip_special_tokens=True) != raw)


class IncrementalDecoder:
    """One sequence's text, token by token: ``push`` returns what became final, ``text`` all of it so far."""

    def __init__(self, tokenizer: Any, skip: Iterable[int] = (), rules: TextRules | None = None) -> None:
        rules = rules if rules is not None else TextRules.of(tokenizer)
        self.tokenizer = tokenizer
        self.tokens: list[int] = []  # every token pushed but those skipped
        self._skip = rules.special | frozenset(skip)
        self._bytes = rules.byte_ids
        self._cleans = rules.cleans
        self._prefix = 0  # the window starts here: tokens[prefix:read] are its context
        self._read = 0  # text of tokens before this is read
        self._context: str | None = ""  # decoded tokens[prefix:read], None until needed
        self._raw = ""  # read text not yet cleaned up (held while a cleanup could still change it)
        self._cleaned_tail = ""  # the last CLEANUP_REACH characters of the raw text cleaned up so far
        self._pieces: list[str] = []
        self._length = 0  # characters returned so far
        self._finished = False

    @property
    def text(self) -> str:
        """All text returned so far: a prefix of the whole output's decoding."""
        return "".join(self._pieces)

    def push(self, token: int) -> str:
        """Add one token; the text that became final with it (often empty while bytes or a cleanup pend)."""
        if self._finished:
            raise RuntimeError("push after finish: the sequence has ended")
        if token in self._skip:
            return ""
        self.tokens.append(token)
        if token in self._bytes:  # the run is open: a later byte can still turn it into U+FFFD
            return ""
        return self._emit(self._clean(self._read_window()))

    def finish(self) -> str:
        """End the sequence: the text still held back, so that everything returned is the whole decoding."""
        if self._finished:
            return ""
        self._finished = True
        whole = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return self._emit(whole[self._length:])

    def _read_window(self) -> str:
        if self._context is None:
            self._context = self._decode(self.tokens[self._prefix : self._read])
        window = self._decode(self.tokens[self._prefix :])
        context = self._context
        if len(window) <= len(context) or not window.startswith(context) or window.endswith("\ufffd"):
            return ""  # nothing new, or not final yet: the window grows until it is
        self._prefix, self._read, self._context = self._read, len(self.tokens), None
        return window[len(context) :]

    def _clean(self, raw: str) -> str:
        """Cleaned-up text of the read raw text up to the last point no later cleanup can reach back past."""
        if not self._cleans:
            return raw
        pending = self._raw + raw
        text = self._cleaned_tail + pending
        cut = len(text)
        while cut > len(self._cleaned_tail) and " " in text[max(0, cut - CLEANUP_REACH) : cut]:
            cut -= 1
        done = cut - len(self._cleaned_tail)
        self._raw = pending[done:]
        self._cleaned_tail = text[:cut][-CLEANUP_REACH:]
        return str(self.tokenizer.clean_up_tokenization(pending[:done]))

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
            self._length += len(text)
        return text
