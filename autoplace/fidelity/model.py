"""The torch model the trackers measure, built from a TransformerSpec with autoplace's parameter count.

What the model is built like, and why (the trackers only see what eager PyTorch keeps):

* with ``flash_attention`` attention is ``F.scaled_dot_product_attention`` with ``enable_gqa``;
  on CPU it dispatches to ``_scaled_dot_product_flash_attention_for_cpu``, which keeps q, k,
  v, the output and an fp32 log-sum-exp per head and token (no ``s x s`` scores), as flash
  attention does on GPU; without it, Megatron's unfused softmax(QK^T) -> dropout -> x V;
* RMSNorm is an autograd function that keeps its input and the fp32 ``rstd`` per token, as
  the fused CUDA kernels do (``torch._fused_rms_norm``, Apex, TE); PyTorch's CPU fallback is
  composite and would also keep the normalized tensor, which no GPU run does;
* SwiGLU is eager ``w2(silu(w1 x) * w3 x)`` as in torchtitan, so autograd keeps four
  ``f``-wide tensors (w1 x, silu(w1 x), w3 x, the product); GeLU MLP, LayerNorm, biases,
  learned positions, tied embeddings and dropout (p=0.1) follow the spec (GPT-3 style);
* a MoE block (Mixtral) has a softmax router and ``experts`` SwiGLU MLPs, with tokens split
  evenly over the experts so that shapes are static (:mod:`autoplace.fidelity.moe`); with
  ep = 1 FSDP2 shards the experts with the rest of the block; with ep > 1 each rank keeps
  ``experts / ep`` of them, tokens travel by all-to-all over the EP group, and the local
  experts are their own FSDP2 unit over the expert-data-parallel group (size dp / ep, EP
  ranks innermost: Megatron's tp-cp-ep-dp order and autoplace's ``group_layout``);
* the loss is ``cross_entropy(logits.float())``, as torchtitan computes it.
"""

from __future__ import annotations

import logging
from typing import Any

from autoplace.errors import BenchmarkError

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise BenchmarkError("autoplace.fidelity needs PyTorch: pip install torch (CPU wheel is enough)") from exc

from autoplace.cost.layers import layer_table
from autoplace.fidelity.moe import MoEFeedForward
from autoplace.specs.model import TransformerSpec

log = logging.getLogger("autoplace")

class _RMSNormFn(torch.autograd.Function):
    """RMSNorm keeping what the fused CUDA kernels keep: the input and fp32 rstd per token."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad.float() * weight.float()
        dx = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        dw = (grad.float() * normed).sum(dim=tuple(range(grad.dim() - 1)))
        return dx.to(x.dtype), dw.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021), half-split form; cos/sin are constants (no grad)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


DROPOUT = 0.1  # GPT-2/3 and Megatron-LM's hidden and attention dropout


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout keeping a 1-byte mask, as CUDA's ``native_dropout`` does; CPU's ``F.dropout``
    keeps a mask in the input's dtype, which no GPU run does."""
    return torch.native_dropout(x, p, True)[0] if p > 0 else x


def _core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: torch.Tensor,
                    dropout: float) -> torch.Tensor:
    """Attention that keeps the ``s x s`` scores, as Megatron-LM's unfused path does (Korthikanti
    et al. 2022, Sec. 4.1: softmax output 2as^2, dropout mask as^2, dropout output 2as^2).
    ``causal`` is built once per forward and shared by every layer."""
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    return _dropout(probs, dropout) @ v


class Attention(nn.Module):
    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        h, d = spec.hidden, spec.dim_head
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.n_kv_heads, d
        self.rope, self.flash = spec.position == "rope", spec.flash_attention
        self.dropout = DROPOUT if spec.dropout else 0.0
        self.wq = nn.Linear(h, spec.heads * d, bias=spec.bias or spec.qkv_bias)
        self.wk = nn.Linear(h, self.kv_heads * d, bias=spec.bias or spec.qkv_bias)
        self.wv = nn.Linear(h, self.kv_heads * d, bias=spec.bias or spec.qkv_bias)
        self.wo = nn.Linear(spec.heads * d, h, bias=spec.bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.rope:  # rotate in (batch, seq, heads, dim) layout and transpose last, as torchtitan
            # does: the attention output then comes back in that layout and the reshape below is a view
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.flash:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout,
                                                 enable_gqa=self.kv_heads != self.heads)
        else:
            if self.kv_heads != self.heads:
                k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
            out = _core_attention(q, k, v, causal, self.dropout)
        return _dropout(self.wo(out.transpose(1, 2).reshape(b, s, -1)), self.dropout)


class MLP(nn.Module):
    """SwiGLU ``w2(silu(w1 x) * w3 x)`` (torchtitan) or GeLU ``w2(gelu(w1 x))`` (GPT, Megatron);
    ``width`` is the inner size when it is not the dense ``ffn_hidden`` (a routed expert's)."""

    def __init__(self, spec: TransformerSpec, width: int | None = None) -> None:
        super().__init__()
        h, f, bias = spec.hidden, width or spec.ffn_hidden, spec.bias
        self.gated = spec.ffn == "swiglu"
        self.dropout = DROPOUT if spec.dropout else 0.0
        self.w1, self.w2 = nn.Linear(h, f, bias=bias), nn.Linear(f, h, bias=bias)
        self.w3 = nn.Linear(h, f, bias=bias) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = F.silu(self.w1(x)) * self.w3(x) if self.w3 is not None else F.gelu(self.w1(x))
        return _dropout(self.w2(inner), self.dropout)


def _norm(spec: TransformerSpec) -> nn.Module:
    # LayerNorm is one aten op on every device (keeps input, mean, rstd); RMSNorm is not, see above
    return RMSNorm(spec.hidden) if spec.norm == "rmsnorm" else nn.LayerNorm(spec.hidden)


def _feed_forward(spec: TransformerSpec, index: int) -> nn.Module:
    """Block ``index``'s MLP: dense, or Mixtral-style routed experts where the spec puts them."""
    moe = spec.moe
    if moe is None or not moe.is_moe_layer(index):
        return MLP(spec)
    return MoEFeedForward(spec.hidden, [MLP(spec, moe.expert_ffn_hidden) for _ in range(moe.experts)], moe.top_k)


class Block(nn.Module):
    def __init__(self, spec: TransformerSpec, index: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = _norm(spec), _norm(spec)
        self.attention = Attention(spec)
        self.feed_forward = _feed_forward(spec, index)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, causal)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Embedding (+ learned positions), blocks, final norm, head (torchtitan's llama3 names)."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_embeddings = (nn.Embedding(spec.max_position or spec.seq_len, spec.hidden)
                               if spec.position == "learned" else None)
        self.dropout = DROPOUT if spec.dropout else 0.0
        self.layers = nn.ModuleList(Block(spec, i) for i in range(spec.layers))
        self.norm = _norm(spec)
        self.output = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        half = spec.dim_head // 2
        inv = 1.0 / (500000.0 ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(spec.seq_len, dtype=torch.float32), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(torch.arange(s, device=tokens.device))
        x = _dropout(x, self.dropout)
        cos_all, sin_all = self.get_buffer("cos"), self.get_buffer("sin")
        cos, sin = cos_all[:s, None, :].to(x.dtype), sin_all[:s, None, :].to(x.dtype)  # (seq, 1, dim/2)
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu(1)
        for block in self.layers:
            x = block(x, cos, sin, causal)
        return self.output(self.norm(x))


def check_supported(spec: TransformerSpec) -> None:
    """The builder covers dense and Mixtral-style MoE decoder-only transformers; say what it does not cover."""
    unsupported = {"shared experts": spec.moe is not None and spec.moe.shared_experts > 0,
                   "attention (MLA)": spec.attention is not None}
    bad = [name for name, on in unsupported.items() if on]
    if bad:
        raise BenchmarkError(f"the tracker model builds dense and routed-expert blocks only; {spec.name} has "
                             f"{', '.join(bad)}")


def blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.get_submodule("layers").children())


def build_model(spec: TransformerSpec) -> nn.Module:
    """The torch model of ``spec``; its parameter count must equal autoplace's, exactly.

    Raises:
        BenchmarkError: an unsupported spec, or a parameter count that differs.
    """
    check_supported(spec)
    model = Transformer(spec)
    built = sum(p.numel() for p in model.parameters())
    expected = int(layer_table(spec).params)
    if built != expected:
        raise BenchmarkError(f"torch model has {built} parameters, autoplace counts {expected} for {spec.name}")
    return model


