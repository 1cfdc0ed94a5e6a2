"""Incremental detokenization says exactly what decoding the whole output says, token by token.

Three tokenizers, each built offline: MiniLM's WordPiece (``##`` continuations, spaces between words; also
with transformers' space cleanup on), a SentencePiece-style BPE with byte fallback (Llama's decoder:
``<0xE2>`` tokens that join into one character), and a byte-level BPE (GPT-2's: characters split across
tokens).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kinfer.consumers.runners.detok import IncrementalDecoder, TextRules
from kinfer.consumers.runners.registry import minilm_path

CORPUS = ["the quick brown fox jumps over the lazy dog", "don't stop, it's fine. Really? yes! we're here",
          "kafka consumers share partitions and rebalance", "tokens stream out one by one  with  spaces"]
TEXTS = ["naïve café", "emoji 😀 and 👍🏽 too", "日本語のテキスト", "mixed: naïve 😀 日本, don't stop. Ok?",
         "  two  spaces "]


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny SentencePiece-style BPE with byte fallback and Llama's decoder: what it never saw (every
    non-ASCII character here) it writes as one token per UTF-8 byte."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
                                                               show_progress=False))
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny GPT-2-style byte-level BPE: a character's bytes may fall in different tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS + TEXTS[:2], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


TOKENIZERS = {
    "wordpiece": lambda: AutoTokenizer.from_pretrained(str(minilm_path())),
    "wordpiece-cleanup": lambda: AutoTokenizer.from_pretrained(str(minilm_path()), clean_up_tokenization_spaces=True),
    "byte-fallback": byte_fallback_tokenizer,
    "byte-level": byte_level_tokenizer,
}
# Tokens that meet the edge cases more often than a random id would: contractions and punctuation that the
# cleanup joins, ``##`` continuations, special tokens, bytes of multi-byte characters, lone spaces.
INTERESTING = {
    "wordpiece": ["do", "n", "'", "t", "s", "re", "ve", "m", "ll", ".", ",", "?", "!", "##s", "##n", "##'", "a",
                  "the", "[SEP]", "[CLS]", "[UNK]", "[PAD]", "é", "日", "##本", "-", "(", ")"],
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> Any:
    tok = TOKENIZERS[request.param]()
    tok.kinfer_name = request.param  # the INTERESTING pool to draw from
    return tok


def interesting(tok: Any) -> list[int]:
    names = INTERESTING.get(tok.kinfer_name)
    if names is None:  # the BPEs are small: every token is worth drawing
        return list(range(len(tok)))
    ids = tok.convert_tokens_to_ids(names)
    assert tok.unk_token_id not in ids[: names.index("[UNK]")], "a pool token is missing from the vocabulary"
    return list(ids)


def stream(tok: Any, ids: list[int], skip: frozenset[int] = frozenset(), rules: TextRules | None = None,
           ) -> tuple[list[str], str, IncrementalDecoder]:
    """Push every id: the piece each push returned, the rest ``finish`` returned, and the decoder."""
    decoder = IncrementalDecoder(tok, skip, rules)
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.finish(), decoder


def assert_streams_the_whole_decoding(tok: Any, ids: list[int], skip: frozenset[int] = frozenset(),
                                      rules: TextRules | None = None) -> list[str]:
    pieces, rest, decoder = stream(tok, ids, skip, rules)
    whole = tok.decode([i for i in ids if i not in skip], skip_special_tokens=True)
    assert "".join(pieces) + rest == whole == decoder.text
    so_far = ""
    for step, piece in enumerate(pieces):
        so_far += piece
        assert whole.startswith(so_far), (step, tok.convert_ids_to_tokens(ids), pieces, whole)
    return pieces


@settings(max_examples=150, derandomize=True, deadline=None)
@given(data=st.data())
def test_pushed_pieces_are_always_a_prefix_and_finally_the_whole_decoding(tokenizer: Any, data: st.DataObject,
                                                                          ) -> None:
    pool = interesting(tokenizer)
    token = st.one_of(st.sampled_from(pool), st.integers(0, len(tokenizer) - 1))
    ids = data.draw(st.lists(token, max_size=40), label="ids")
    skip = frozenset(data.draw(st.lists(st.sampled_from(pool), max_size=2), label="skip"))
    assert_streams_the_whole_decoding(tokenizer, ids, skip, TextRules.of(tokenizer))


@pytest.mark.parametrize("text", TEXTS)
def test_characters_split_over_tokens_arrive_whole(tokenizer: Any, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = assert_streams_the_whole_decoding(tokenizer, ids)
    assert not any("\ufffd" in p for p in pieces)  # never half a character
    if tokenizer.kinfer_name != "byte-level":  # WordPiece lower-cases and splits; byte-level BPE is lossless
        return
    assert "".join(pieces) == text


def test_byte_fallback_tokens_join_into_one_character() -> None:
    tok = byte_fallback_tokenizer()
    ids = tok("café 😀 日本", add_special_tokens=False)["input_ids"]
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens.count("<0xF0>") == 1 and "<0xA9>" in tokens and "<0xE6>" in tokens  # é, 😀 and 日 are bytes
    pieces, rest, _ = stream(tok, ids)
    emoji = tokens.index("<0xF0>")
    assert pieces[emoji : emoji + 4] == ["", "", "", ""]  # the run of four bytes is held while it is open
    assert pieces[emoji + 4] == "😀 "  # and read whole once a token that is not a byte closes it
    assert ("".join(pieces), rest) == ("café 😀 ", "日本")  # a run still open at the end comes with finish
    assert_streams_the_whole_decoding(tok, ids)


def test_a_later_byte_can_still_spoil_a_run_so_an_open_run_is_held() -> None:
    tok = byte_fallback_tokenizer()
    c3, a9, space = tok.convert_tokens_to_ids(["<0xC3>", "<0xA9>", "▁"])
    assert tok.decode([c3, a9]) == "é" and tok.decode([c3, a9, a9, space]) == "\ufffd" * 3 + " "
    pieces = assert_streams_the_whole_decoding(tok, [c3, a9, a9, space])
    assert pieces == ["", "", "", "\ufffd" * 3 + " "]


def test_wordpiece_continuations_and_cleaned_up_spaces_stream_exactly() -> None:
    plain = AutoTokenizer.from_pretrained(str(minilm_path()))
    cleaned = AutoTokenizer.from_pretrained(str(minilm_path()), clean_up_tokenization_spaces=True)
    ids = plain.convert_tokens_to_ids(["the", "token", "##izer", "do", "n", "'", "t", "stop", ",", "ok", "?"])
    assert plain.decode(ids) == "the tokenizer do n ' t stop, ok?"  # the decoder's own cleanup: per token
    assert cleaned.decode(ids) == "the tokenizer don't stop, ok?"  # transformers' cleanup: across tokens
    assert_streams_the_whole_decoding(plain, ids)
    pieces = assert_streams_the_whole_decoding(cleaned, ids)
    assert "".join(pieces[:4]) == "the tokenizer"  # " do" waits: a later " n't" takes its space away


def test_each_push_decodes_a_short_window_not_the_whole_output() -> None:
    tok = AutoTokenizer.from_pretrained(str(minilm_path()))
    windows: list[int] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(tok, name)

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            windows.append(len(ids))
            return str(tok.decode(ids, **kwargs))

    ids = tok(" ".join(CORPUS * 10), add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(Counting(), rules=TextRules.of(tok))
    for i in ids:
        decoder.push(i)
    assert len(ids) > 300 and max(windows) <= 4
    decoder.finish()
    assert windows[-1] == len(ids)  # the end decodes the whole output once, to hand back all that was held
    assert decoder.text == tok.decode(ids)


def test_text_is_cleaned_up_exactly_when_decode_cleans_it_up() -> None:
    plain = AutoTokenizer.from_pretrained(str(minilm_path()))
    cleaned = AutoTokenizer.from_pretrained(str(minilm_path()), clean_up_tokenization_spaces=True)
    assert not TextRules.of(plain).cleans and TextRules.of(cleaned).cleans
    for tok in (byte_level_tokenizer(), byte_fallback_tokenizer()):  # BPEs asking for it: transformers decides
        tok.clean_up_tokenization_spaces = True
        ids = tok("a . b ' c , don't", add_special_tokens=False)["input_ids"]
        raw = tok.decode(ids, clean_up_tokenization_spaces=False)
        assert raw == "a . b ' c , don't"
        assert TextRules.of(tok).cleans == (tok.decode(ids) != raw)
        assert_streams_the_whole_decoding(tok, ids)
