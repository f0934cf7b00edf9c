"""What the drafter's work costs a decoding step on this CPU in ATen calls (``probe_eagle.py --cost``)."""

import os
import time

import torch
import torch.nn.functional as F

from medusa_core.gguf import demo_gguf_file

from .drafter import Drafter


@torch.inference_mode()
def step_cost(cached: int = 400, draft_vocabulary: int = 8192) -> None:
    """Mean wall time (ms) of one step's drafter work in ATen calls: the k accepted rows' catch-up
    through the layer with a KV cache of ``cached`` entries, draft 1's top-1 over ``draft_vocabulary`` tokens,
    draft 2 chained from it (random bf16 weights: the cost does not depend on their values)."""
    from transformers import AutoConfig

    from medusa_core.gguf import gguf_model_folder

    torch.set_num_threads(2)
    cfg = AutoConfig.from_pretrained(gguf_model_folder(os.environ.get("MEDUSA_DEMO_GGUF") or demo_gguf_file()))
    d = Drafter(cfg).to(torch.bfloat16).eval()
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    proj = torch.randn(draft_vocabulary, h, dtype=torch.bfloat16)
    keys, values = (torch.randn(1, nh, cached, h // nh, dtype=torch.bfloat16) for _ in range(2))

    def layer(x, start, keys, values):
        q, k, v = d.qkv(x[None], torch.arange(start, start + len(x)))
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        mask = torch.ones(len(x), keys.shape[2], dtype=torch.bool).tril(keys.shape[2] - len(x))
        return d.out(x[None], F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))[0], keys, values

    def step(rows):
        f, e = torch.randn(rows, h, dtype=torch.bfloat16), torch.randn(rows, h, dtype=torch.bfloat16)
        out, k, v = layer(d.fc(torch.cat([f, e], -1)), cached, keys, values)
        first = (out[-1:] @ proj.T).argmax(-1)
        out2, _, _ = layer(d.fc(torch.cat([out[-1:], e[-1:]], -1)), cached + rows, k, v)
        return first, (out2 @ proj.T).argmax(-1)

    # The same work in fewer calls: fused q/k/v and gate/up products, torch's one-call RMS norm, RoPE tables, a
    # preallocated cache written in place, no mask for the one-row draft.
    eps, hd = cfg.rms_norm_eps, h // nh
    w_qkv = torch.cat([d.q.weight, d.k.weight, d.v.weight]).T.contiguous()
    w_gu, w_o, w_d, w_fc = torch.cat([d.g.weight, d.u.weight]).T.contiguous(), d.o.weight.T, d.d.weight.T, d.fc.weight.T
    inv = 1.0 / d.theta ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.arange(cached + 64).float()[:, None] * inv[None]
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16)[:, None] for f in (torch.cos, torch.sin))
    cache = torch.randn(2, nh, cached + 64, hd, dtype=torch.bfloat16)

    def fused(x, start, keep):
        r = len(x)
        qkv = (F.rms_norm(x, (h,), d.n1.w, eps) @ w_qkv).view(r, 3, nh, hd)
        qk = qkv[:, :2]
        qk = qk * cos[start : start + r, None] + torch.cat([-qk[..., hd // 2 :], qk[..., : hd // 2]], -1) * sin[start : start + r, None]
        if keep:  # accepted rows: their keys and values stay
            cache[0, :, start : start + r] = qk[:, 1].transpose(0, 1)
            cache[1, :, start : start + r] = qkv[:, 2].transpose(0, 1)
            k, v = cache[0, :, : start + r], cache[1, :, : start + r]
        else:
            k = torch.cat([cache[0, :, :start], qk[:, 1].transpose(0, 1)], 1)
            v = torch.cat([cache[1, :, :start], qkv[:, 2].transpose(0, 1)], 1)
        mask = None if r == 1 else torch.ones(r, start + r, dtype=torch.bool).tril(start)
        a = F.scaled_dot_product_attention(qk[:, 0].transpose(0, 1), k, v, attn_mask=mask)
        x = x + a.transpose(0, 1).reshape(r, h) @ w_o
        g, u = (F.rms_norm(x, (h,), d.n2.w, eps) @ w_gu).chunk(2, -1)
        return x + (F.silu(g) * u) @ w_d

    def fused_step(rows):
        f, e = torch.randn(rows, h, dtype=torch.bfloat16), torch.randn(rows, h, dtype=torch.bfloat16)
        out = fused(torch.cat([f, e], -1) @ w_fc, cached, True)
        first = (out[-1:] @ proj.T).argmax(-1)
        out2 = fused(torch.cat([out[-1:], e[-1:]], -1) @ w_fc, cached + rows, False)
        return first, (out2 @ proj.T).argmax(-1)

    for name, fn in (("as trained (module calls)", step), ("fused calls", fused_step)):
        for rows in (1, 2, 3):
            for _ in range(20):
                fn(rows)
            t, n = time.perf_counter(), 300
            for _ in range(n):
                fn(rows)
            print(f"{name}: catch-up of {rows} row(s) + 2 drafts: {(time.perf_counter() - t) / n * 1e3:.3f} ms")
