"""A quick look at trees shaped by the heads' confidence (issue 20, part 2) on the demo: the calibration of
the heads' path probabilities (share of nodes accepted per predicted-probability bin, heads only on
``optimised_8``), then tokens per step and tokens/s of heads, hybrid and shaped hybrid trees against the plain
loop, interleaved per prompt, every greedy output checked identical. Figures: docs/BENCH.md.

    python scripts/shaped_trees.py

It wraps ``MedusaModel._candidates`` to read each step's path probabilities: a measurement, not an API.
"""

import time, torch, collections
from medusa_core import load_medusa_model, DraftConfig
from medusa_core.bench.prompts import load_prompts, encode_prompt
torch.set_num_threads(2)
m = load_medusa_model("demo")
ps = load_prompts(None, 8, None)
# 1. calibration of the heads' path probabilities on optimised_8 (heads only)
orig = m._candidates
cap = {}
def wrapped(tree, hidden, root, with_log_p=False):
    tokens, log_p = orig(tree, hidden, root, tree.num_nodes > 1)
    if log_p is not None:
        cap["p"] = ((tree.bias == 0).float() @ log_p).exp().tolist()
    return tokens, (log_p if with_log_p else None)
m._candidates = wrapped
bins = collections.defaultdict(lambda: [0, 0])
for p in ps:
    ids = encode_prompt(m.tokenizer, p, None)
    for r in m.generate(ids, max_new_tokens=128, tree="optimised_8"):
        if r.tree_nodes > 1 and "p" in cap:
            for i in range(1, r.tree_nodes):
                b = min(int(cap["p"][i] * 10), 9)
                bins[b][0] += i in r.accepted_nodes; bins[b][1] += 1
        cap.clear()
m._candidates = orig
print("calibration: predicted path prob bin -> accepted share (count)")
for b in sorted(bins):
    a, n = bins[b]; print(f"  {b/10:.1f}-{(b+1)/10:.1f}: {a/n:.2f} ({n})")
# 2. speed: interleaved per prompt
configs = [("heads:tuned", dict(tree="tuned", drafts="heads")), ("hybrid:tuned", dict(tree="tuned", drafts="hybrid")),
           ("hybrid:opt8 shaped .2", dict(tree="optimised_8", drafts="hybrid", draft_config=DraftConfig(min_head_probability=0.2))),
           ("hybrid:opt8 shaped .35", dict(tree="optimised_8", drafts="hybrid", draft_config=DraftConfig(min_head_probability=0.35))),
           ("heads:opt8 shaped .2", dict(tree="optimised_8", drafts="heads", draft_config=DraftConfig(min_head_probability=0.2))),
           ("baseline", dict(medusa=False))]
tot = {k: [0, 0, 0.0] for k, _ in configs}
for p in ps:
    ids = encode_prompt(m.tokenizer, p, None)
    ref = None
    for name, kw in configs:
        t0 = time.perf_counter(); recs = list(m.generate(ids, max_new_tokens=128, **kw)); dt = time.perf_counter() - t0
        out = [t for r in recs for t in r.token_ids]
        ref = ref or out
        assert out == ref, name
        tot[name][0] += len(out); tot[name][1] += len(recs) - 1; tot[name][2] += dt
for k, (t, s, dt) in tot.items():
    print(f"{k:24s} tok/step {(t-8)/s:.2f} tok/s {t/dt:.1f}")
