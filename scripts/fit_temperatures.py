"""Fit the demo heads' temperatures (temperature scaling, Guo et al. 2017) on held-out greedy replies and
store them as ``head_temperatures`` in the heads' ``medusa_calibration.json`` (issue 20, part 2).

The demo model as it is served (``load_medusa_model("demo")``: its backbone precision, its heads in their
dtype) writes greedy replies to the held-out prompts (``assets/demo/prompts/heldout.jsonl``, never used for
training); head k's temperature T_k then minimises the NLL of the token the backbone produced k+2
positions ahead under softmax(logits_k / T_k) (``medusa_core.train.head_temperatures``). Held-out prompts
that are also in the benchmark's shipped set are left out, so ``scripts/shaped_trees.py``'s reliability
table on the shipped prompts is measured on replies the fit never saw. Trees shaped per step use the
calibrated probabilities (``MedusaModel.generate``, ``draft_config.min_head_probability``).

    python scripts/fit_temperatures.py [--quantization gguf|nf4] [--prompts 60] [--max-new-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json

import torch

from medusa_core import DraftConfig, load_medusa_model
from medusa_core.bench.prompts import encode_prompt, load_prompts
from medusa_core.loading import BACKBONE_VARIANT, CALIBRATION_FILE, DEMO_MODEL_DIR
from medusa_core.train import collect_positions, head_temperatures

HELDOUT = DEMO_MODEL_DIR / "prompts" / "heldout.jsonl"


def mean_nll(heads, hidden: torch.Tensor, labels: torch.Tensor, temperatures) -> list[float]:
    """Each head's mean NLL (nats) of its targets under softmax(logits_k / T_k), over every labelled position."""
    dtype = next(heads.parameters()).dtype
    total, count = [0.0] * heads.num_heads, [0] * heads.num_heads
    with torch.inference_mode():
        for start in range(0, len(hidden), 512):
            logits = heads(hidden[start : start + 512].to(dtype)).float()  # [K, B, V]
            for k, t in enumerate(temperatures):
                lab = labels[start : start + 512, k]
                ok = lab != -100
                total[k] += torch.nn.functional.cross_entropy(logits[k][ok] / t, lab[ok], reduction="sum").item()
                count[k] += int(ok.sum())
    return [s / max(1, n) for s, n in zip(total, count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="auto", help="the backbone precision whose heads to calibrate (auto: gguf on a CPU)")
    parser.add_argument("--prompts", type=int, default=60, help="held-out prompts: the first N not in the shipped benchmark set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_medusa_model("demo", quantization=args.quantization)
    rows = []
    shipped = {p.text for p in load_prompts()}
    for prompt in [p for p in load_prompts(HELDOUT) if p.text not in shipped][: args.prompts]:
        ids = encode_prompt(model.tokenizer, prompt, None)
        records = model.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0.0, repetition_penalty=1.0,
                                 draft_config=DraftConfig(min_head_probability=0.0))  # greedy: the backbone's own reply
        rows.append({"prompt_ids": ids[0].tolist(), "reply_ids": [t for r in records for t in r.token_ids]})
    hidden, labels = collect_positions(model.backbone, rows, model.num_heads)
    temperatures = [round(t, 4) for t in head_temperatures(model.heads, hidden, labels)]
    before = mean_nll(model.heads, hidden, labels, [1.0] * model.num_heads)
    after = mean_nll(model.heads, hidden, labels, temperatures)
    variant = DEMO_MODEL_DIR / BACKBONE_VARIANT.format(model.quantization or "none")
    target = (variant if (variant / CALIBRATION_FILE).exists() else DEMO_MODEL_DIR) / CALIBRATION_FILE
    record = json.loads(target.read_text(encoding="utf-8"))
    record["head_temperatures"] = temperatures
    target.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"{len(rows)} held-out replies, {len(hidden)} positions, backbone {model.quantization or 'none'}")
    for k, (t, b, a) in enumerate(zip(temperatures, before, after)):
        print(f"  head {k}: T = {t:.3f}   NLL {b:.3f} -> {a:.3f} nats")
    print(f"wrote head_temperatures to {target}")


if __name__ == "__main__":
    main()
