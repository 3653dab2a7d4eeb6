"""The one torch model: a decoder built from a TransformerSpec with autoplace's parameter count.

The runtime trains it and the tracker harness (:mod:`autoplace.fidelity.trackers`) measures
it on fake tensors, parallelized by the same appliers (:mod:`autoplace.runtime.parallel`).
Module names follow torchtitan's ``llama3/model.py`` (``tok_embeddings``,
``layers.<i>.attention.wq``, ``feed_forward.w1/w2/w3``, ``norm``, ``output``) so the tensor
parallel plan reads like torchtitan's.  ``layers`` is a ModuleDict keyed by the global block
index: a pipeline stage keeps only its blocks, under their global names; a MoE block's experts
are keyed by global expert index the same way (:mod:`autoplace.runtime.moe`).

What it is built like, and why (the trackers only see what eager PyTorch keeps):

* with ``flash_attention`` attention is ``F.scaled_dot_product_attention`` with ``enable_gqa``;
  on CPU it dispatches to ``_scaled_dot_product_flash_attention_for_cpu``, which keeps q, k,
  v, the output and an fp32 log-sum-exp per head and token (no ``s x s`` scores), as flash
  attention does on GPU; without it, Megatron's unfused softmax(QK^T) -> dropout -> x V;
  with context parallelism, ring attention (:mod:`autoplace.runtime.ring`);
* RMSNorm is an autograd function that keeps its input and the fp32 ``rstd`` per token, as
  the fused CUDA kernels do (``torch._fused_rms_norm``, Apex, TE); PyTorch's CPU fallback is
  composite and would also keep the normalized tensor, which no GPU run does;
* SwiGLU is eager ``w2(silu(w1 x) * w3 x)`` as in torchtitan, so autograd keeps four
  ``f``-wide tensors; GeLU MLP, LayerNorm, biases, learned positions, tied embeddings and
  dropout (p=0.1) follow the spec (GPT-3 style);
* the loss is ``cross_entropy(logits.float())``, as torchtitan computes it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoplace.cost.layers import layer_table
from autoplace.errors import BenchmarkError
from autoplace.runtime.moe import MoE
from autoplace.runtime.ring import ring_attention
from autoplace.specs.model import TransformerSpec

DROPOUT = 0.1  # GPT-2/3 and Megatron-LM's hidden and attention dropout
ROPE_THETA = 500000.0  # Llama 3


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


class AttentionCore(nn.Module):
    """Rotary + causal attention on ``[b, s, heads, d]`` q, k, v; returns ``[b, heads, s, d]``.

    What selective recompute recomputes (Korthikanti et al. 2022, Sec. 5: the ``s x s`` part of
    attention is cheap to recompute).  With a context-parallel group (``cp_group``, set by
    ``parallel.apply_cp``) each rank holds one contiguous chunk of the sequence and attends by
    ring attention over the group.
    """

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.rope, self.flash = spec.position == "rope", spec.flash_attention
        self.dropout = DROPOUT if spec.dropout else 0.0
        self.cp_group: Any = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                causal: torch.Tensor) -> torch.Tensor:
        if self.rope:  # rotate in (batch, seq, heads, dim) layout and transpose last, as torchtitan
            # does: the attention output then comes back in that layout and the caller's reshape is a view
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.cp_group is not None:
            return ring_attention(q, k, v, self.cp_group)
        if self.flash:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout,
                                                  enable_gqa=k.shape[1] != q.shape[1])
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each K/V head
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        return _core_attention(q, k, v, causal, self.dropout)


class Attention(nn.Module):
    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        h, d = spec.hidden, spec.dim_head
        self.head_dim = d
        self.dropout = DROPOUT if spec.dropout else 0.0
        self.wq = nn.Linear(h, spec.heads * d, bias=spec.qkv_bias)
        self.wk = nn.Linear(h, spec.n_kv_heads * d, bias=spec.qkv_bias)
        self.wv = nn.Linear(h, spec.n_kv_heads * d, bias=spec.qkv_bias)
        self.wo = nn.Linear(spec.heads * d, h, bias=spec.bias)
        self.core: nn.Module = AttentionCore(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads/tp of them
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        out = self.core(q, k, v, cos, sin, causal)
        return _dropout(self.wo(out.transpose(1, 2).reshape(b, s, -1)), self.dropout)


class MLP(nn.Module):
    """SwiGLU ``w2(silu(w1 x) * w3 x)`` (torchtitan) or GeLU ``w2(gelu(w1 x))`` (GPT, Megatron);
    ``width`` is the inner size when it is not the dense ``ffn_hidden`` (a routed expert's)."""

    def __init__(self, spec: TransformerSpec, width: int | None = None) -> None:
        super().__init__()
        h, f, bias = spec.hidden, width or spec.ffn_hidden, spec.bias
        self.dropout = DROPOUT if spec.dropout else 0.0
        self.w1, self.w2 = nn.Linear(h, f, bias=bias), nn.Linear(f, h, bias=bias)
        self.w3 = nn.Linear(h, f, bias=bias) if spec.ffn == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = F.silu(self.w1(x)) * self.w3(x) if self.w3 is not None else F.gelu(self.w1(x))
        return _dropout(self.w2(inner), self.dropout)


def _norm(spec: TransformerSpec) -> nn.Module:
    # LayerNorm is one aten op on every device (keeps input, mean, rstd); RMSNorm is not, see above
    return RMSNorm(spec.hidden) if spec.norm == "rmsnorm" else nn.LayerNorm(spec.hidden)


def _feed_forward(spec: TransformerSpec, index: int, routing: str) -> nn.Module:
    """Block ``index``'s MLP: dense, or routed (+ shared) experts where the spec puts them."""
    moe = spec.moe
    if moe is None or not moe.is_moe_layer(index):
        return MLP(spec)
    width = moe.shared_experts * (moe.shared_ffn_hidden or moe.expert_ffn_hidden)
    return MoE(spec.hidden, [MLP(spec, moe.expert_ffn_hidden) for _ in range(moe.experts)], moe.top_k,
               MLP(spec, width) if width else None, routing)


class Block(nn.Module):
    def __init__(self, spec: TransformerSpec, index: int, routing: str = "topk") -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = _norm(spec), _norm(spec)
        self.attention = Attention(spec)
        self.feed_forward = _feed_forward(spec, index, routing)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, causal)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Embedding (+ learned positions), blocks, final norm, head; on a pipeline stage that does
    not hold the embedding or the head they are None and the forward skips them (torchtitan).

    ``cp_rank`` (set by ``parallel.apply_cp``) says which contiguous chunk of the sequence this
    rank's tokens are: positions ``cp_rank * s ..< (cp_rank + 1) * s``.
    """

    def __init__(self, spec: TransformerSpec, routing: str = "topk") -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_embeddings: nn.Module | None = (nn.Embedding(spec.max_position or spec.seq_len, spec.hidden)
                                                 if spec.position == "learned" else None)
        self.dropout = DROPOUT if spec.dropout else 0.0
        self.layers = nn.ModuleDict({str(i): Block(spec, i, routing) for i in range(spec.layers)})
        self.norm: nn.Module | None = _norm(spec)
        self.output: nn.Module | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.cp_rank = 0
        half = spec.dim_head // 2
        inv = 1.0 / (ROPE_THETA ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(spec.seq_len, dtype=torch.float32), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():  # small normal init, like GPT-2 / torchtitan
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
            else:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s, first = tokens.shape[1], self.tok_embeddings is not None
        offset = self.cp_rank * s
        positions = torch.arange(offset, offset + s, device=tokens.device)
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if first and self.pos_embeddings is not None:
            x = x + self.pos_embeddings(positions)
        x = _dropout(x, self.dropout) if first else x
        cos_all, sin_all = self.get_buffer("cos"), self.get_buffer("sin")
        cos = cos_all[offset:offset + s, None, :].to(x.dtype)  # (seq, 1, dim/2)
        sin = sin_all[offset:offset + s, None, :].to(x.dtype)
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu(1)
        for block in self.layers.values():
            x = block(x, cos, sin, causal)
        x = self.norm(x) if self.norm is not None else x
        return self.output(x) if self.output is not None else x


def pipeline_stage(model: Transformer, start: int, stop: int, first: bool, last: bool) -> Transformer:
    """A model chunk sharing ``model``'s blocks [start, stop), and the embedding / head only on the
    first / last stage; chunks of one model are disjoint, so a rank's virtual stages need no copy."""
    chunk = Transformer.__new__(Transformer)
    nn.Module.__init__(chunk)
    chunk.tok_embeddings = model.tok_embeddings if first else None
    chunk.pos_embeddings = model.pos_embeddings if first else None
    chunk.dropout, chunk.cp_rank = model.dropout, model.cp_rank
    chunk.layers = nn.ModuleDict({i: b for i, b in model.layers.items() if start <= int(i) < stop})
    chunk.norm = model.norm if last else None
    chunk.output = model.output if last else None
    chunk.register_buffer("cos", model.get_buffer("cos"), persistent=False)
    chunk.register_buffer("sin", model.get_buffer("sin"), persistent=False)
    return chunk


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks in order (a pipeline chunk: the ones it holds)."""
    return list(model.get_submodule("layers").children())


def check_supported(spec: TransformerSpec) -> None:
    """The model covers dense and routed-expert decoder-only transformers; say what it does not cover.

    Raises:
        BenchmarkError: multi-head latent attention (MLA).
    """
    if spec.attention is not None:
        raise BenchmarkError(f"the torch model builds Llama/GPT attention only; {spec.name} has attention (MLA)")


def build_model(spec: TransformerSpec, routing: str = "topk") -> Transformer:
    """The torch model of ``spec``; its parameter count must equal autoplace's, exactly.

    Args:
        routing: ``"topk"`` (training) or ``"balanced"`` (fake tensors; see :mod:`autoplace.runtime.moe`).

    Raises:
        BenchmarkError: an unsupported spec, or a parameter count that differs.
    """
    check_supported(spec)
    model = Transformer(spec, routing)
    built = sum(p.numel() for p in model.parameters())
    expected = int(layer_table(spec).params)
    if built != expected:
        raise BenchmarkError(f"torch model has {built} parameters, autoplace counts {expected} for {spec.name}")
    return model


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (fp32)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
