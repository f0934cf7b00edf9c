"""The shipped demo model (assets/demo): it loads in 4-bit and full precision and its heads predict."""

import pytest
import torch

from medusa_core import DEMO_MODEL_DIR, load_medusa_model

PROMPT = "Return the sum of the squares of a list of numbers."


def _prompt_ids(model) -> torch.Tensor:
    return model.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


@pytest.fixture(scope="module")
def demo_fp32():
    return load_medusa_model("demo", quantization=None)


def test_the_demo_model_ships_heads_calibration_and_a_chat_template():
    for name in ("config.json", "medusa_lm_head.safetensors", "medusa_calibration.json", "README.md"):
        assert (DEMO_MODEL_DIR / name).exists(), name
    size = sum(f.stat().st_size for f in DEMO_MODEL_DIR.rglob("*") if f.is_file())
    assert size <= 40 * 2**20


def test_the_demo_model_loads_in_4bit_and_generates_text_that_decodes():
    import bitsandbytes as bnb

    model = load_medusa_model("demo")  # the app's default: NF4 backbone
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.backbone.modules())
    assert model.num_heads == 4 and model.default_tree in model.trees
    tokens = [t for r in model.generate(_prompt_ids(model), max_new_tokens=48) for t in r.token_ids]
    text = model.tokenizer.decode(tokens, skip_special_tokens=True)
    assert len(tokens) > 0 and text.strip() and "\ufffd" not in text


def test_greedy_medusa_on_the_demo_model_equals_plain_greedy_and_accepts_several_tokens_per_step(demo_fp32):
    ids = _prompt_ids(demo_fp32)
    medusa = list(demo_fp32.generate(ids, max_new_tokens=64))
    plain = list(demo_fp32.generate(ids, max_new_tokens=64, medusa=False))
    tokens = [t for r in medusa for t in r.token_ids]
    assert tokens == [t for r in plain for t in r.token_ids]
    # trained heads genuinely predict: random heads give about 1 token per step
    assert len(tokens) / len(medusa) > 1.5
