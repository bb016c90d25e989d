"""The ingress's tokenizer: a Hugging Face tokenizer loaded from a local path or a model name.

Why here: the ingress tokenizes once, so the router can hash block-aligned prefixes and the
replica never re-tokenizes. A relative path is resolved against the working directory, then the
repository root (Ray workers may start elsewhere than ``serve run``'s directory).

``max_text_bytes`` is a bound checked before any tokenization: no token covers more than
``max_token_bytes`` bytes of text (the longest vocabulary entry, added tokens included, in UTF-8:
a byte-level BPE symbol is one or two UTF-8 bytes per text byte, a SentencePiece piece spells its
text or more), so a prompt of more UTF-8 bytes than ``max_model_len * max_token_bytes`` cannot fit
the context and is refused without tokenizing it. It holds only if the tokenizer's normalizer
does not shrink text: none, Prepend, a Replace by something no shorter, or NFD keep every byte;
NFC / NFKC / NFKD shrink text by at most 3x (three characters composed into one of no fewer
bytes; a full-width letter to ASCII), so the bound is taken 4x looser; with any other
normalizer (one that may delete text) there is no bound (``max_token_bytes`` is None).

``encode_within`` tokenizes a long text's prefix first, so a prompt far over the context (but
under the byte bound) is refused after a bounded amount of work, not after tokenizing megabytes:
a prefix of ``PREFIX_CHARS_PER_TOKEN * limit`` characters, cut at a whitespace, yields tokens that
the whole text's tokenization also has, up to the last word before the cut (pre-tokenizers split
at whitespace; ``PREFIX_MARGIN`` tokens cover the cut word and any merge across it), so a prefix
with more than ``limit + PREFIX_MARGIN`` tokens proves the text has more than ``limit``.

``encode_kept`` (vLLM's ``truncate_prompt_tokens``: keep a prompt's first or last ``keep`` tokens)
tokenizes only the kept side's piece of a long text by the same argument: a prefix ending (a
suffix starting) at a whitespace with more than ``keep + PREFIX_MARGIN`` tokens has the whole
text's first (last) ``keep`` tokens. It tries a piece of ``PREFIX_CHARS_PER_TOKEN * keep``
characters, then one of ``(keep + PREFIX_MARGIN) * max_token_bytes + CUT_LOOKBACK``, which is sure
to hold that many tokens (a token covers at most ``max_token_bytes`` bytes, a character at least
one), so the work is bounded by the kept tokens, not the text's length. A piece with no whitespace
near its cut is cut inside the word there: the work stays bounded (a 7.5 MB word would take the
tokenizer 5 s whole, its last 32,767 tokens' sure piece 2.3 s), and the kept ids are the piece's,
which for a word of more than ``CUT_LOOKBACK`` characters across the cut may differ from the
whole text's near the cut (BPE merges inside a word cut in two can differ along it; vLLM cuts its
text the same way). A text shorter than the pieces, or one whose tokenizer has no byte bound, is
tokenized whole (the latter up to the body limit).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

#: Normalizers that never make text shorter in UTF-8 bytes, and those that shrink it by at most 3x.
KEEPS_BYTES = frozenset({"Prepend", "NFD"})
SHRINKS_AT_MOST_3X = frozenset({"NFC", "NFKC", "NFKD"})
#: ``encode_within``: the prefix tokenized first, in characters per token of the limit (prompts
#: average 3-5 characters per token; a text past it with fewer tokens is tokenized whole)
PREFIX_CHARS_PER_TOKEN = 8
#: tokens the cut can cost: the word it splits, and a merge across it
PREFIX_MARGIN = 256
#: how far back from the cut a whitespace is looked for
CUT_LOOKBACK = 4096
#: The side ``truncate_prompt_tokens`` cuts without a ``truncation_side``: the start, keeping the
#: prompt's last tokens, as vLLM's generation servers load every tokenizer (vllm-project/vllm,
#: vllm/tokenizers/registry.py: ``truncation_side`` "left" unless configured; a tokenizer's own
#: setting, "right" for most, does not count there)
DEFAULT_TRUNCATION_SIDE = "left"


class TooManyTokens(ValueError):  # noqa: N818 - it is what the caller refuses
    """A text has more tokens than the limit: at least ``at_least`` (a lower bound)."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


def resolve_path(name: str) -> str:
    """``name`` as an existing local path if it is one (cwd first, then the repo), else as is
    (a hub model name, for clusters that can download)."""
    p = Path(name)
    if p.is_absolute():
        return str(p)
    for base in (Path.cwd(), REPO_ROOT):
        if (base / p).exists():
            return str(base / p)
    return name


def shrink_factor(normalizer: dict[str, Any] | None) -> int | None:
    """How many times shorter (in UTF-8 bytes) ``normalizer`` (a ``tokenizer.json`` normalizer
    entry) can make a text: 1, 4 (module docstring), or None when it may delete text."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for n in normalizer.get("normalizers", []):
            f = shrink_factor(n)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        content = normalizer.get("content", "")
        return 1 if literal is not None and len(content.encode()) >= len(literal.encode()) else None
    if kind in KEEPS_BYTES:
        return 1
    if kind in SHRINKS_AT_MOST_3X:
        return 4
    return None


class Tokenizer:
    """Encode prompts and chat messages to token ids, decode ids to text."""

    def __init__(self, name: str) -> None:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        self.path = resolve_path(name)
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id
        self.max_token_bytes = self._max_token_bytes()
        self._token_texts: dict[int, str] = {}  # token_text's cache (at most the vocabulary)
        # a stream's every frame decodes twice (router/detokenize.py): call the Rust tokenizer
        # itself where the Python wrapper would only pass the ids through (1.3 against 4.7 us
        # for 8 ids); a wrapper that cleans up spaces keeps its own decode
        backend = getattr(self.tok, "backend_tokenizer", None)
        self._fast_decode = (backend.decode if backend is not None
                             and not getattr(self.tok, "clean_up_tokenization_spaces", True) else None)

    def _max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of text one token can stand for, times the normalizer's shrink
        factor (module docstring); None when unknown. O(vocabulary), once."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is None:
            return None
        factor = shrink_factor(json.loads(backend.to_str()).get("normalizer"))
        if factor is None:
            return None
        return factor * max(4, max(len(s.encode()) for s in self.tok.get_vocab()))

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (a log probability's ``token``, as vLLM's
        server writes it). Cached per id: O(1) after the first."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tok.decode([token_id])
        return text

    def max_text_bytes(self, max_model_len: int) -> int | None:
        """The most UTF-8 bytes a text of ``max_model_len`` tokens can have (None: no bound)."""
        return None if self.max_token_bytes is None else max_model_len * self.max_token_bytes

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``text``'s ids; ``add_special_tokens``: with what the tokenizer puts around a text (a
        BOS for Llama's), as vLLM's completions do by default."""
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_kept(self, text: str, keep: int, side: str, add_special_tokens: bool = False) -> list[int]:
        """``encode(text)``'s first (``side`` "right": cut from the right) or last ("left") ``keep``
        ids, tokenizing only the kept side's piece of a long text (module docstring). O(piece)."""
        pieces = [PREFIX_CHARS_PER_TOKEN * keep]
        if self.max_token_bytes is not None:
            pieces.append((keep + PREFIX_MARGIN) * self.max_token_bytes + CUT_LOOKBACK)
        for size in pieces:
            if len(text) <= size + CUT_LOOKBACK:
                break
            if side == "right":
                space = text.rfind(" ", size - CUT_LOOKBACK, size)
                piece = text[:space] if space > 0 else None
            else:
                space = text.find(" ", len(text) - size, len(text) - size + CUT_LOOKBACK)
                piece = text[space:] if space >= 0 else None
            if piece is None:  # a word across the cut: cut in it, the work bounded (module docstring)
                piece = text[:size] if side == "right" else text[-size:]
            ids = self.encode(piece, add_special_tokens)
            if len(ids) > keep + PREFIX_MARGIN:
                return kept(ids, (keep, side))
        return kept(self.encode(text, add_special_tokens), (keep, side))

    def check_within(self, text: str, limit: int) -> None:
        """Raise ``TooManyTokens`` when a prefix of ``text`` alone proves it has more than
        ``limit`` tokens (module docstring); O(min(len(text), PREFIX_CHARS_PER_TOKEN * limit))."""
        cut = PREFIX_CHARS_PER_TOKEN * limit
        if len(text) > cut:
            space = text.rfind(" ", max(0, cut - CUT_LOOKBACK), cut)
            n = len(self.tok(text[: space if space > 0 else cut], add_special_tokens=False)["input_ids"])
            if n > limit + PREFIX_MARGIN:
                raise TooManyTokens(n - PREFIX_MARGIN)

    def encode_within(self, text: str, limit: int, add_special_tokens: bool = False) -> list[int]:
        """``encode(text)`` after ``check_within``: a text far over ``limit`` costs a bounded
        prefix, not its whole tokenization."""
        self.check_within(text, limit)
        return self.encode(text, add_special_tokens)

    def encode_chat_within(self, messages: list[dict[str, Any]], limit: int,
                           tools: list[dict[str, Any]] | None = None,
                           template: dict[str, Any] | None = None, add_special_tokens: bool = False) -> list[int]:
        """``encode_chat`` after ``check_within`` on the text the template renders (the messages'
        text, their calls' arguments, the tools as JSON: their tokens are no more than the
        templated prompt's)."""
        texts = [m["content"] for m in messages]
        texts += [c["function"]["arguments"] for m in messages for c in m.get("tool_calls", ())]
        if tools:
            texts.append(json.dumps(tools))
        if sum(len(t) for t in texts) > PREFIX_CHARS_PER_TOKEN * limit:  # else no prefix to check
            self.check_within("\n".join(texts), limit)
        return self.encode_chat(messages, tools, template, add_special_tokens)

    def encode_chat_fitting(self, messages: list[dict[str, Any]], budget: int, fixed: int = 0,
                            tools: list[dict[str, Any]] | None = None, template: dict[str, Any] | None = None,
                            add_special_tokens: bool = False) -> list[int]:
        """The chat's prompt with as few of its oldest messages dropped as make it ``budget``
        tokens or fewer (the Responses API's ``truncation: auto``): the first ``fixed`` messages
        (the instructions) and the last one always stay, and the kept part never starts with a
        tool's answer (its call would be gone). ``TooManyTokens`` when even the shortest such
        prompt is over (its count, at least). A binary search over the cut, as dropping more never
        lengthens the prompt: O(log messages) tokenizations, each bounded by
        ``encode_chat_within``'s prefix check."""
        head = messages[:fixed]
        cuts = [i for i in range(fixed, len(messages)) if i == fixed or messages[i].get("role") != "tool"]
        shortest: list[int] | None = None
        over = 0

        def fitting(i: int) -> list[int] | None:
            nonlocal over
            try:
                ids = self.encode_chat_within(head + messages[i:], budget, tools, template, add_special_tokens)
            except TooManyTokens as e:
                over = e.at_least
                return None
            if len(ids) > budget:
                over = len(ids)
                return None
            return ids

        lo, hi = 0, len(cuts) - 1  # the first cut that fits is in cuts[lo..hi], if any
        while lo <= hi:
            mid = (lo + hi) // 2
            ids = fitting(cuts[mid])
            if ids is None:
                lo = mid + 1
            else:
                shortest, hi = ids, mid - 1
        if shortest is None:
            raise TooManyTokens(over)
        return shortest

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template: dict[str, Any] | None = None, add_special_tokens: bool = False) -> list[int]:
        """The chat template's prompt for ``messages`` (and ``tools``, which templates render or
        not), with the ``template`` options (``add_generation_prompt``, default true;
        ``continue_final_message``; the template's own variables); ``add_special_tokens``: the
        tokenizer's own around the rendered text too (vLLM's chat parameter, default false: the
        template writes them)."""
        if add_special_tokens:
            return self.encode(self.render_chat(messages, tools, template), True)
        out = self._apply_template(messages, tools, template, tokenize=True)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return list(out)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template: dict[str, Any] | None = None) -> str:
        """The chat template's prompt as text (``encode_chat`` is its ids, tokenized without
        special tokens added)."""
        return str(self._apply_template(messages, tools, template, tokenize=False))

    def _apply_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        template: dict[str, Any] | None, tokenize: bool) -> Any:
        """The chat template over ``messages`` with the request's ``template`` options (the
        assistant's header by default)."""
        options = {"add_generation_prompt": True, **(template or {})}
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=tokenize, **options)

    def decode_all(self, ids: list[int]) -> str:
        """``ids``' text with their special tokens (``/detokenize``, ``skip_special_tokens``
        false)."""
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=False)
        return self.tok.decode(ids, skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=True)
        return self.tok.decode(ids, skip_special_tokens=True)

    def decoder(self, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """The decode an answer's text uses: ``decode``, or with ``skip_special_tokens`` false (vLLM's
        parameter) one that keeps the special tokens' text."""
        return self.decode if skip_special_tokens else self.decode_all


def kept(ids: list[int], keep: tuple[int, str] | None) -> list[int]:
    """``ids`` as ``truncate_prompt_tokens`` leaves them: ``keep`` = (how many, side), side "right"
    keeping the first ones and "left" the last; all of them when they are no more (or no keep)."""
    if keep is None or len(ids) <= keep[0]:
        return ids
    return ids[: keep[0]] if keep[1] == "right" else ids[-keep[0]:]


def utf8_len_over(text: str, bound: int) -> int | None:
    """``text``'s UTF-8 length if it is over ``bound``, else None; O(1) when the character count
    decides it (a character is 1 to 4 bytes), O(len) otherwise."""
    if len(text) > bound:
        return len(text.encode("utf-8", "surrogatepass"))
    if 4 * len(text) <= bound:
        return None
    n = len(text.encode("utf-8", "surrogatepass"))
    return n if n > bound else None
