"""The ingress's tokenizer: a Hugging Face tokenizer loaded from a local path or a model name.

Why here: the ingress tokenizes once, so the router can hash block-aligned prefixes and the
replica never re-tokenizes. A relative path is resolved against the working directory, then the
repository root (Ray workers may start elsewhere than ``serve run``'s directory).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


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


class Tokenizer:
    """Encode prompts and chat messages to token ids, decode ids to text."""

    def __init__(self, name: str) -> None:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        self.path = resolve_path(name)
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return list(out)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
