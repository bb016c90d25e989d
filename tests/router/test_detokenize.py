"""Incremental detokenization with the shipped tiny byte-level BPE tokenizer: deltas join to the
whole decode however the tokens are split, and a multi-byte character split over chunks comes
out whole, never as U+FFFD. The stop strings' filter: the same text however it is split, with
vLLM's min_tokens (no stop ending in the first text) and include_stop_str_in_output."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.detokenize import REPLACEMENT, IncrementalDetokenizer, StopFilter
from router.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer("deploy/models/fairway-tiny")


def stream(tok: Tokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tok.decode)
    out, start = [], 0
    for end in sorted(set(cuts)) + [len(ids)]:
        out.append(d.push(ids[start:end]))
        start = end
    out.append(d.finish())
    return out


TEXTS = ["Hello, world! The quick brown fox.", "naïve café — 東京 🌍🚀 ok", "  spaces\tand\nnewlines  ", "🙂"]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_gives_the_text(tok, text):
    ids = tok.encode(text)
    deltas = stream(tok, ids, list(range(1, len(ids))))
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any(REPLACEMENT in d for d in deltas)


def test_a_character_split_over_chunks_waits_for_its_last_byte(tok):
    ids = tok.encode("a🌍")
    d = IncrementalDetokenizer(tok.decode)
    assert d.push(ids[:1]) == "a"
    parts = [d.push([t]) for t in ids[1:]]
    assert len(ids) > 2 and parts[:-1] == [""] * (len(parts) - 1) and parts[-1] == "🌍"
    assert d.finish() == ""


def test_an_incomplete_character_at_the_end_comes_out_on_finish(tok):
    ids = tok.encode("🌍")
    d = IncrementalDetokenizer(tok.decode)
    assert d.push(ids[:1]) == ""
    assert d.finish() == tok.decode(ids[:1])


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=0, max_size=40), cuts=st.lists(st.integers(0, 60), max_size=12))
def test_deltas_join_to_the_whole_decode(tok, text, cuts):
    ids = tok.encode(text)
    assert "".join(stream(tok, ids, [c for c in cuts if c <= len(ids)])) == tok.decode(ids)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_deltas_join_to_the_whole_decode_for_any_token_ids(tok, data):
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))  # invalid UTF-8 too
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=10))
    assert "".join(stream(tok, ids, cuts)) == tok.decode(ids)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=511), max_size=24))
def test_decode_is_the_wrappers_decode(tok, ids):
    """``Tokenizer.decode`` calls the Rust tokenizer directly; it must say what the Hugging Face
    wrapper says for any ids, special tokens (skipped) included."""
    assert tok._fast_decode is not None  # the shipped tokenizer takes the direct path
    ids = [i % len(tok.tok) for i in ids]
    assert tok.decode(ids) == tok.tok.decode(ids, skip_special_tokens=True)


def filtered(pieces: list[str], stops: list[str], unarmed: int = 0, include: bool = False) -> tuple[str, bool]:
    """The text ``StopFilter`` lets through for ``pieces`` pushed in turn (the first ``unarmed``
    of them unarmed, the last final), and whether it stopped."""
    f = StopFilter(stops, include)
    out = "".join(f.push(p, final=i == len(pieces) - 1, armed=i >= unarmed) for i, p in enumerate(pieces))
    return out, f.stopped


@pytest.mark.parametrize(("pieces", "stops", "unarmed", "include", "want"), [
    (["ab", "cSTO", "Pdef"], ["STOP"], 0, False, ("abc", True)),
    (["ab", "cSTO", "Pdef"], ["STOP"], 0, True, ("abcSTOP", True)),
    (["abc"], ["x"], 0, False, ("abc", False)),
    (["a STOP b", " STOP c"], ["STOP"], 1, False, ("a STOP b ", True)),  # the first in the unarmed text: passed
    (["a ST", "OP b"], ["STOP"], 1, False, ("a ", True)),  # begun unarmed, ended armed: a stop
    (["a STOP", " b"], ["STOP"], 1, False, ("a STOP b", False)),  # ended in the unarmed text: not a stop
    (["xx", "yzz"], ["yz", "xyz"], 0, True, ("xxyz", True)),  # two end together: the longer
    (["xx", "yzz"], ["yz", "xyz"], 0, False, ("x", True)),
    (["abba"], ["bb", "abba"], 0, False, ("a", True)),  # the first to end, not the first to start
    (["ab", "ba"], ["bb", "abba"], 0, False, ("a", True)),  # the same in pieces
    (["aaaaab", "b", "a"], ["b", "bba"], 1, False, ("aaaaab", True)),  # "bba" would end after "b" does
])
def test_stop_filter_cases(pieces, stops, unarmed, include, want):
    assert filtered(pieces, stops, unarmed, include) == want


def reference(text: str, stops: list[str], armed_from: int, include: bool) -> str:
    """The whole text's answer, character by character as a stream meets it: at the first end
    past ``armed_from`` where some stop string ends, cut before the longest one ending there
    (``include``: after it)."""
    for end in range(armed_from + 1, len(text) + 1):
        ending = [s for s in stops if end - len(s) >= 0 and text[end - len(s):end] == s]
        if ending:
            return text[:end] if include else text[: end - max(len(s) for s in ending)]
    return text


@settings(max_examples=2000, deadline=None)
@given(text=st.text("abc", max_size=30), stops=st.lists(st.text("abc", min_size=1, max_size=3), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=5), armed_from=st.integers(0, 30), include=st.booleans())
def test_stop_filter_is_the_whole_texts_cut_however_it_is_split(text, stops, cuts, armed_from, include):
    armed_from = min(armed_from, len(text))
    bounds = sorted({c for c in cuts if c <= len(text)} | {armed_from, len(text)})
    pieces, start, unarmed = [], 0, 0
    for end in bounds:
        pieces.append(text[start:end])
        unarmed += end <= armed_from
        start = end
    got, _ = filtered(pieces, stops, unarmed, include)
    assert got == reference(text, stops, armed_from, include)
