"""A small Llama-style decoder built from a TransformerSpec (torch).

The module tree follows torchtitan's ``llama3/model.py`` names (``tok_embeddings``,
``layers.<i>.attention.wq``, ``feed_forward.w1/w2/w3``, ``norm``, ``output``) so the tensor
parallel plan reads like torchtitan's.  ``layers`` is a ModuleDict keyed by the global block
index: a pipeline stage keeps only the blocks it owns, under their global names.  A MoE
block's ``feed_forward`` is a :class:`MoE` whose ``experts`` are keyed by global expert index
the same way, so an expert-parallel rank keeps only its experts under their single-process names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autoplace.specs.model import MoE as MoESpec
from autoplace.specs.model import TransformerSpec


def _rotary(x: torch.Tensor, offset: int = 0, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), rotate-half form; x is [b, s, heads, d] holding
    positions ``offset ..< offset + s`` (a context-parallel rank holds a later chunk)."""
    seq, dim = x.shape[1], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    pos = torch.arange(offset, offset + seq, dtype=torch.float32, device=x.device)
    angles = torch.outer(pos, inv)  # [s, d/2]
    cos = torch.cat([angles.cos()] * 2, dim=-1)[None, :, None, :]
    sin = torch.cat([angles.sin()] * 2, dim=-1)[None, :, None, :]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class AttentionCore(nn.Module):
    """Rotary + causal scaled-dot-product attention: what selective recompute recomputes
    (Korthikanti et al. 2022, Sec. 5: the s x s part of attention is cheap to recompute).

    With a context-parallel group (``cp_group``, set by ``parallel.apply_cp``) each rank holds
    one contiguous chunk of the sequence: K and V are all-gathered along the sequence and the
    local queries attend causally with their chunk's offset (Llama 3, Dubey et al. 2024, Sec.
    3.3.2).  The all-gather's autograd backward reduce-scatters dK and dV to their owners.
    """

    def __init__(self) -> None:
        super().__init__()
        self.cp_group: Any = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        offset, mask = 0, None
        if self.cp_group is not None:
            offset = dist.get_rank(self.cp_group) * q.shape[1]
            q, k = _rotary(q, offset), _rotary(k, offset)
            k, v = _gather_sequence(k, v, self.cp_group)
            mask = torch.arange(offset, offset + q.shape[1], device=q.device)[:, None] >= torch.arange(
                k.shape[1], device=q.device)[None, :]
        else:
            q, k = _rotary(q), _rotary(k)
        rep = q.shape[2] // k.shape[2]  # grouped-query attention: share each K/V head
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None)
        return out.transpose(1, 2)


def _gather_sequence(k: torch.Tensor, v: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([b, s/cp, heads, d]) of every rank of ``group``, in rank order along the sequence,
    in one all-gather (functional collectives: autograd reduce-scatters the gradient back)."""
    from torch.distributed._functional_collectives import all_gather_single

    kv = torch.stack((k, v)).permute(2, 0, 1, 3, 4).contiguous()  # [s/cp, 2, b, heads, d]: gather dim 0
    full = all_gather_single(kv, 0, group).permute(1, 2, 0, 3, 4)  # [2, b, s, heads, d]
    return full[0], full[1]


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, hidden, bias=False)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds heads/tp of them
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        return self.wo(self.core(q, k, v).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int, gated: bool) -> None:
        super().__init__()
        self.gated = gated
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:  # SwiGLU (Shazeer 2020)
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class MoE(nn.Module):
    """Routed experts plus optional shared experts (DeepSeek-MoE, Dai et al. 2024).

    The router takes a softmax over all experts and keeps the top-k probabilities as gates,
    without renormalizing them (Switch / DeepSeek-V2 / Qwen-MoE's default; renormalizing would
    starve the router of gradient at top_k = 1).  There is no capacity factor: every token
    reaches its k experts, so a run is exactly reproducible on one process whatever the
    expert-parallel degree.  The shared experts form one FFN of ``shared_experts`` times the
    width, which is the sum of that many separate experts.

    With an expert-parallel group (``ep_group``, set by ``parallel.apply_ep``) this rank holds
    ``experts / ep`` consecutive experts; routed token copies travel to their expert's rank in one
    all-to-all and come back in a second (torch's autograd-aware functional all-to-all: the
    backward is the reverse all-to-all of the gradients).
    """

    def __init__(self, hidden: int, moe: MoESpec, gated: bool) -> None:
        super().__init__()
        self.n_experts, self.top_k = moe.experts, moe.top_k
        self.router = nn.Linear(hidden, moe.experts, bias=False)
        self.experts = nn.ModuleDict({str(e): FeedForward(hidden, moe.expert_ffn_hidden, gated)
                                      for e in range(moe.experts)})
        width = moe.shared_experts * (moe.shared_ffn_hidden or moe.expert_ffn_hidden)
        self.shared_experts = FeedForward(hidden, width, gated) if width else None
        self.ep_group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(flat).float(), dim=-1)
        gates, chosen = probs.topk(self.top_k, dim=-1)  # [tokens, k]
        order = chosen.flatten().argsort(stable=True)  # routed copies grouped by expert
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        rows = flat[order // self.top_k]
        done = self._local(rows, counts.tolist()) if self.ep_group is None else self._exchange(rows, counts)
        copies = torch.empty_like(done).index_copy(0, order, done).view(-1, self.top_k, flat.shape[-1])
        out = (copies * gates.to(copies.dtype)[..., None]).sum(dim=1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(x.shape)

    def _local(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts, in index order, each on its run of ``rows`` (possibly empty: every
        expert runs, so its gradient is a zero tensor rather than None, as on one process)."""
        experts = sorted(self.experts.items(), key=lambda kv: int(kv[0]))
        return torch.cat([e(part) for (_, e), part in zip(experts, rows.split(counts), strict=True)])

    def _exchange(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each routed copy to its expert's rank, run the local experts, send the results back.

        The per-expert counts go first (a small all-to-all of ``experts`` int64s) so every rank
        knows its split sizes; received rows arrive grouped by source rank and are regrouped by
        local expert before the experts run, then put back for the return trip.
        """
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        n = dist.get_world_size(self.ep_group)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        recv = recv_counts.view(n, -1)  # [source rank, local expert]
        send_splits = counts.view(n, -1).sum(dim=1).tolist()
        recv_splits = recv.sum(dim=1).tolist()
        got = all_to_all_single_autograd(rows, recv_splits, send_splits, self.ep_group)
        regroup = _expert_major(recv)
        done = self._local(got[regroup], recv.sum(dim=0).tolist())
        back = torch.empty_like(done).index_copy(0, regroup, done)
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.ep_group)


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder rows stored source-major (``counts[s, e]`` rows of local expert e
    from source s) into expert-major order."""
    starts = torch.cumsum(counts.flatten(), 0) - counts.flatten()
    starts = starts.view(counts.shape)
    runs = [torch.arange(int(starts[s, e]), int(starts[s, e] + counts[s, e]))
            for e in range(counts.shape[1]) for s in range(counts.shape[0])]
    return torch.cat(runs)


class Block(nn.Module):
    def __init__(self, spec: TransformerSpec, index: int = 0) -> None:
        super().__init__()
        h = spec.hidden
        self.attention_norm = nn.RMSNorm(h, eps=1e-5)
        self.attention = Attention(h, spec.heads, spec.n_kv_heads, spec.dim_head)
        self.ffn_norm = nn.RMSNorm(h, eps=1e-5)
        gated = spec.ffn == "swiglu"
        self.feed_forward: nn.Module = (MoE(h, spec.moe, gated) if spec.moe is not None and spec.moe.is_moe_layer(index)
                                        else FeedForward(h, spec.ffn_hidden, gated))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Embedding, blocks, final norm and untied output layer; any of them may be None on a
    pipeline stage that does not hold it (the forward then skips it, as torchtitan's does)."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.layers)})
        self.norm: nn.Module | None = nn.RMSNorm(spec.hidden, eps=1e-5)
        self.output: nn.Module | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        for p in self.parameters():  # small normal init, like GPT-2 / torchtitan
            nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.ones_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for block in self.layers.values():
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def pipeline_stage(model: Transformer, start: int, stop: int, first: bool, last: bool) -> Transformer:
    """A model chunk sharing ``model``'s blocks [start, stop), and the embedding / head only on the
    first / last stage; chunks of one model are disjoint, so a rank's virtual stages need no copy."""
    chunk = Transformer.__new__(Transformer)
    nn.Module.__init__(chunk)
    chunk.tok_embeddings = model.tok_embeddings if first else None
    chunk.layers = nn.ModuleDict({i: b for i, b in model.layers.items() if start <= int(i) < stop})
    chunk.norm = model.norm if last else None
    chunk.output = model.output if last else None
    return chunk


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (fp32)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
