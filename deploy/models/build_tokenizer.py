"""Build the tiny local tokenizer ``deploy/models/fairway-tiny`` (no hub download needed).

A byte-level BPE (4,096 tokens) trained on this repository's own text, with Llama-3-style special
tokens and chat template, saved in the Hugging Face layout (``tokenizer.json`` +
``tokenizer_config.json``) so ``transformers.AutoTokenizer`` and vLLM load it from the path.
The result is committed; rerun this only to change it:

    .venv/bin/python deploy/models/build_tokenizer.py [--out deploy/models/fairway-tiny]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[2]
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
#: Llama-3-style turns. With ``tools``, a first system turn lists them as JSON, one per line, and
#: says how a call looks; an assistant turn's ``tool_calls`` follow its text in that form, and a
#: tool's answer is a turn of role ``tool``. Without tools or calls it renders as before they existed.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "You may call these functions. A call is {\"name\": function name, \"parameters\": arguments}.\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{\"name\": {{ call['function']['name'] | tojson }}, \"parameters\": {{ call['function']['arguments'] }}}"
    "{% endfor %}{% endif %}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def corpus() -> list[str]:
    files = sorted(p for ext in ("*.md", "*.py") for p in ROOT.glob(f"**/{ext}") if ".venv" not in p.parts)
    return [p.read_text(errors="replace") for p in files]


def build(out: Path, vocab_size: int = 4096) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
        "model_max_length": 32768,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: config[k] for k in ("bos_token", "eos_token", "pad_token")}, indent=2) + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "deploy" / "models" / "fairway-tiny")
    ap.add_argument("--vocab-size", type=int, default=4096)
    args = ap.parse_args()
    build(args.out, args.vocab_size)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
