"""The GPU suite's model: a plain-torch Llama-style decoder (pre-norm RMSNorm, fused QKV, SwiGLU MLP, untied head).

1.37B parameters at the defaults; random init, no positional encoding (positions do not change the cost of a step).
Its weight matrices are 2-D, so ZenFlowAdamW offloads all of them; the RMSNorm weights stay resident.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Decoder", "DecoderConfig"]


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of the Llama-style decoder (pre-norm RMSNorm, fused QKV, SwiGLU MLP, untied head)."""

    vocab: int = 32000
    """Vocabulary size: embedding and head are [vocab, d_model] matrices, as in real fine-tuning."""
    d_model: int = 2048
    """Width of the residual stream."""
    n_layer: int = 24
    """Transformer blocks; 24 at d_model 2048 gives 1.37B parameters."""
    n_head: int = 16
    """Attention heads (head dim 128, what flash attention is fastest at)."""
    ffn: int = 5632
    """Hidden width of the SwiGLU MLP (about 8/3 d_model, rounded to a multiple of 256)."""

    def num_params(self) -> int:
        d, f = self.d_model, self.ffn
        return 2 * self.vocab * d + self.n_layer * (4 * d * d + 3 * d * f + 2 * d) + d


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics: bf16 mean-of-squares loses the small activations' scale.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.attn_norm = RMSNorm(cfg.d_model)
        self.wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.w_gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn, bias=False)
        self.w_down = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def loss(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, self.cfg.vocab), target.view(-1))
