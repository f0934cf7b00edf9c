"""What the training tests share: a small distilled reply file."""

from medusa_core.train import distill, read_distilled
from tiny_models import tiny_backbone, tiny_tokenizer


def distilled_rows(tmp_path, n=12):
    """A tiny backbone's greedy replies to ``n`` chats, distilled in batches of 5: (backbone, tokenizer, rows)."""
    tok = tiny_tokenizer()
    backbone = tiny_backbone(eos_token_id=tok.convert_tokens_to_ids("<|end|>"))
    chats = [[{"role": "user", "content": "def add" + " a" * i}] for i in range(n)]
    out = distill(backbone, tok, chats, tmp_path / "d.jsonl", max_new_tokens=24, batch_size=5)
    return backbone, tok, read_distilled(out)
