"""Build ``deploy/models/fairway-tiny-llama``: a tiny Llama with seeded random weights for vLLM on CPU.

No hub download: the architecture is a ``LlamaConfig`` built here, the weights are random
(seeded, so every build is identical), and the tokenizer is the committed byte-level BPE in
``deploy/models/fairway-tiny`` (vocab 4,096, Llama-3-style special tokens). The output is the
Hugging Face layout vLLM loads offline: ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files. It generates noise, which is all the router
needs: real prefill/decode cost and a real prefix cache. The directory is git-ignored; build it with

    .venv-vllm/bin/python deploy/models/build_tiny_model.py [--out deploy/models/fairway-tiny-llama]

(``scripts/vllm_cpu_setup.sh`` runs this.) Needs torch + transformers (the ``.venv-vllm`` venv).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT / "deploy" / "models" / "fairway-tiny"
DEFAULT_OUT = ROOT / "deploy" / "models" / "fairway-tiny-llama"


def special_ids(tokenizer_dir: Path) -> dict[str, int]:
    """Ids of the bos/eos/pad tokens named in the tokenizer config, read from tokenizer.json."""
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    added = {t["content"]: t["id"] for t in json.loads((tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]}
    return {k: added[cfg[k]] for k in ("bos_token", "eos_token", "pad_token")}


def build(
    out: Path,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    vocab_size: int = 4096,
    max_position_embeddings: int = 32768,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    ids = special_ids(TOKENIZER_DIR)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=ids["bos_token"],
        eos_token_id=ids["eos_token"],
        pad_token_id=ids["pad_token"],
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(model.config, "dtype"):  # transformers >= 4.56; older ones write torch_dtype
        model.config.dtype = dtype
    else:
        model.config.torch_dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids["bos_token"], eos_token_id=ids["eos_token"], pad_token_id=ids["pad_token"], do_sample=False
    ).save_pretrained(out)
    for f in sorted(TOKENIZER_DIR.iterdir()):
        if f.is_file():
            shutil.copy2(f, out / f.name)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {layers} layers, hidden {hidden}, {heads} heads / {kv_heads} kv, {n_params / 1e6:.2f}M params")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--max-position-embeddings", type=int, default=32768)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    build(
        args.out,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        dtype=args.dtype,
        seed=args.seed,
    )
    print(f"built in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
