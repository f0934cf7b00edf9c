"""GreedyHead: the float32 argmax of an LM head at bfloat16 cost (medusa_core/greedy.py)."""

import pytest
import torch
from torch import nn

from medusa_core.greedy import GreedyHead

pytestmark = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="GreedyHead is for CPUs with native bfloat16 matmuls"
)


def lm_head(vocab: int, hidden: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(hidden, vocab, bias=False)
    nn.init.normal_(head.weight, std=0.05)
    return head.requires_grad_(False)


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 64])
def test_the_argmax_equals_the_float32_lm_heads_on_random_states(rows):
    head = lm_head(5000, 64)
    hidden = torch.randn(rows, 64) * 3
    assert torch.equal(GreedyHead(head)(hidden), head(hidden).argmax(dim=1))


def test_a_near_tie_that_bfloat16_cannot_see_is_settled_in_float32():
    # Rows 7 and 8 of W round to the same bfloat16 values, but row 8 is larger by a tiny amount in
    # the direction of h: its float32 logit wins by ~1e-3, while the bfloat16 logits tie (and
    # argmax takes the first, 7).
    head = lm_head(1000, 64, seed=1)
    hidden = torch.randn(1, 64)
    w = head.weight
    w[7] = (hidden[0] * 2).bfloat16().float()  # exactly representable: the top logit by far
    w[8] = w[7] + 1e-5 * torch.sign(hidden[0]) * w[7].abs()
    assert torch.equal(w[8].bfloat16(), w[7].bfloat16())
    exact = head(hidden)[0]
    assert exact[8] > exact[7] and exact.argmax() == 8
    assert nn.functional.linear(hidden.bfloat16(), w.bfloat16()).argmax() == 7  # bfloat16 alone is wrong
    assert GreedyHead(head)(hidden).tolist() == [8]


def test_only_bias_free_float32_linear_heads_qualify():
    head = lm_head(100, 16)
    assert GreedyHead.suits(head, torch.device("cpu"))
    assert not GreedyHead.suits(head, torch.device("meta"))
    assert not GreedyHead.suits(nn.Linear(16, 100), torch.device("cpu"))  # a bias
    assert not GreedyHead.suits(head.to(torch.bfloat16), torch.device("cpu"))
    with pytest.raises(ValueError, match="bias-free float32"):
        GreedyHead(nn.Linear(16, 100))
