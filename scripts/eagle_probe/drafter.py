"""The probe's EAGLE-style drafter as a torch module (Li et al. 2024): fc over [f_t, e(x_{t+1})], one pre-norm Llama
layer, read by the backbone's frozen LM head."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMS(nn.Module):
    """RMS norm with a learned scale (Llama's)."""

    def __init__(self, h, eps):
        super().__init__()
        self.w, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        return self.w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope(x, pos, theta):
    """x [B, h, W, d], pos [W] int."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device).float() / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Drafter(nn.Module):
    """The drafter: fc [H, 2H] over [f_t, e(x_{t+1})], then one pre-norm Llama layer (full multi-head attention with
    the backbone's RoPE θ, SiLU-gated MLP); its output [.., H] is read by the backbone's LM head. ``window`` > 0 limits
    attention to the last ``window`` positions (a measurement; training uses all, 0). With ``fused`` > 1, f_t is
    ``fused(states)``: ``fuse`` [H, fused·H] over the states of several backbone layers (EAGLE-3), each but the last (the
final-norm state) RMS-normed."""

    def __init__(self, cfg, fused=1):
        super().__init__()
        h = cfg.hidden_size
        self.fuse = nn.Linear(fused * h, h, bias=False) if fused > 1 else None
        if self.fuse is not None:  # it starts as the final-norm state, so a drafter of that state alone continues
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -h:].copy_(torch.eye(h))
        # the intermediate states are the residual stream (norms in the thousands); the last is already final-normed
        self.fuse_norms = nn.ModuleList(RMS(h, cfg.rms_norm_eps) for _ in range(fused - 1)) if fused > 1 else None
        self.window = 0
        h, self.nh = cfg.hidden_size, cfg.num_attention_heads
        self.theta, self.hd = cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"], h // self.nh
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.n1, self.n2 = RMS(h, cfg.rms_norm_eps), RMS(h, cfg.rms_norm_eps)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.g, self.u = nn.Linear(h, cfg.intermediate_size, bias=False), nn.Linear(h, cfg.intermediate_size, bias=False)
        self.d = nn.Linear(cfg.intermediate_size, h, bias=False)

    def fused(self, states):
        """f_t from ``states`` [B, W, fused, H] (with ``fuse``), or ``states`` [B, W, H] as they are."""
        if self.fuse is None:
            return states
        normed = [norm(states[:, :, i]) for i, norm in enumerate(self.fuse_norms)]
        return self.fuse(torch.cat([*normed, states[:, :, -1]], -1))

    def qkv(self, x, pos):
        B, W, _ = x.shape
        y = self.n1(x)
        q, k, v = (m(y).view(B, W, self.nh, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        return rope(q, pos, self.theta), rope(k, pos, self.theta), v

    def out(self, x, a):
        B, W, _ = x.shape
        x = x + self.o(a.transpose(1, 2).reshape(B, W, -1))
        y = self.n2(x)
        return x + self.d(F.silu(self.g(y)) * self.u(y))

    def forward(self, feats, emb, feats2=None, emb2=None):
        """Stream X: inputs (f_t, e_{t+1}) at positions t, causal. Stream Y (optional): inputs at positions t that
        attend to X at positions < t and to themselves. Returns (out_x [B, W, H], out_y or None)."""
        B, W, _ = feats.shape
        pos = torch.arange(W, device=feats.device)
        x = self.fc(torch.cat([feats, emb], -1))
        qx, kx, vx = self.qkv(x, pos)
        back = pos[:, None] - pos[None, :]  # [W, W] i - j
        win = self.window
        if win:
            ox = self.out(x, F.scaled_dot_product_attention(qx, kx, vx, attn_mask=(back >= 0) & (back < win)))
        else:
            ox = self.out(x, F.scaled_dot_product_attention(qx, kx, vx, is_causal=True))
        if feats2 is None:
            return ox, None
        y = self.fc(torch.cat([feats2, emb2], -1))
        qy, ky, vy = self.qkv(y, pos)
        earlier = (back > 0) & (back < win) if win else back > 0
        mask = torch.cat([earlier, torch.eye(W, dtype=torch.bool, device=x.device)], 1)
        a = F.scaled_dot_product_attention(qy, torch.cat([kx, ky], 2), torch.cat([vx, vy], 2), attn_mask=mask)
        return ox, self.out(y, a)
