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

from safetensors.torch import save_file

from medusa_core import MedusaHeads, save_medusa_heads
from medusa_core.eagle import LAYOUT as DRAFTER_LAYOUT

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


def random_drafter(path: Path, config, seed: int = 0, **override: torch.Tensor) -> Path:
    """An EAGLE-style drafter file (``medusa_core.eagle.LAYOUT``) of random weights (σ 0.05) for a backbone ``config``
    at ``path``; ``override`` replaces tensors by name (a misfit file for the loader's checks). Returns ``path``."""
    g = torch.Generator().manual_seed(seed)
    sizes = {"H": config.hidden_size, "2H": 2 * config.hidden_size, "I": config.intermediate_size}
    tensors = {name: torch.randn([sizes[d] for d in dims], generator=g) * 0.05 for name, dims in DRAFTER_LAYOUT.items()}
    tensors.update(override)
    save_file(tensors, str(path))
    return path


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


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = ["def add(a, b):\n    return a + b\n", "héllo wörld, the café ☕ 世界 😀\n"] * 20


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE tokenizer (any text encodes; all 256 bytes are tokens) with
    ChatML's control tokens ``<|im_start|>``, ``<|im_end|>`` (EOS) and ``CHATML_TEMPLATE``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Mistral-style tokenizer: BPE over characters with spaces as ``▁``, byte fallback to the 256
    tokens ``<0x00>`` … ``<0xFF>`` for anything else, a decoder that joins runs of byte tokens (an
    invalid UTF-8 run decodes to one U+FFFD per byte), ChatML's control tokens and template."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    space = "\u2581"
    pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme="first", split=False)
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizer
    ascii_only = [t.encode("ascii", "ignore").decode() for t in _CORPUS]  # the rest falls back to bytes
    trained.train_from_iterator(ascii_only, trainers.BpeTrainer(vocab_size=120, special_tokens=specials))
    learned = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>",
        additional_special_tokens=specials[2:4],
    )
    fast.chat_template = CHATML_TEMPLATE
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
