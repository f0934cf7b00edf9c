"""Tiny random models, tokenizers and Medusa checkpoints that tests build on disk in milliseconds."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from medusa_core import MedusaHeads, save_medusa_heads

VOCAB = 96
HIDDEN = 64
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
ARCHITECTURES = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "gemma": lambda: GemmaConfig(**_COMMON, head_dim=16),
    "phi3": lambda: Phi3Config(**{**_COMMON, "num_key_value_heads": 4}),
}


def tiny_backbone(arch: str = "llama", seed: int = 0, eos_token_id: int | None = None, **overrides):
    """A random ``arch`` causal LM (vocab 96, hidden 64, 2 layers) in float32, eval mode."""
    config = ARCHITECTURES[arch]()
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    return model


def random_heads(backbone, num_heads: int = 4, seed: int = 1, scale: float = 0.5) -> MedusaHeads:
    """Heads initialised from the backbone with random residual blocks (they propose mostly wrong tokens)."""
    heads = MedusaHeads.from_backbone(backbone, num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head in heads:
            for p in head.parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return heads


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly ``VOCAB`` tokens with the chat template and EOS ``<|end|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = sorted(set("abcdefghijklmnopqrstuvwxyz ():=\n"))
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, initial_alphabet=alphabet)
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", pad_token="<|endoftext|>", additional_special_tokens=specials[1:4]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tiny_medusa(folder: Path, arch: str = "llama", num_heads: int = 4) -> Path:
    """A head-only Medusa checkpoint in ``folder/heads`` whose backbone (with tokenizer) is ``folder/base``.

    The backbone's EOS is the tokenizer's ``<|end|>``. Returns the heads folder.
    """
    tok = tiny_tokenizer()
    backbone = tiny_backbone(arch, eos_token_id=tok.convert_tokens_to_ids("<|end|>"))
    backbone.save_pretrained(folder / "base")
    tok.save_pretrained(folder / "base")
    heads = random_heads(backbone, num_heads)
    return save_medusa_heads(heads, folder / "heads", base_model_name_or_path=str(folder / "base"))
