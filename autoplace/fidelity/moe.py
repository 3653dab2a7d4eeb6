"""A Mixtral-style mixture-of-experts MLP for the tracker model, routed without data dependence.

On fake tensors a router's choices have no values, so ``topk`` indices cannot decide how
many tokens each expert sees (``nonzero``/``where`` on them has no static shape).  The layer
therefore routes by a fixed rule with the outcome autoplace's cost model assumes: every
expert receives exactly ``tokens * top_k / experts`` tokens (perfect balance, no capacity
factor and no dropped tokens -- Mixtral and torchtitan are dropless).  Everything else is
what an eager Mixtral layer does (Hugging Face ``MixtralSparseMoeBlock``, Jiang et al. 2024):

* the router is a bias-free linear layer to ``experts`` logits, softmax in fp32;
* a token's gates are the router probabilities of its chosen experts, renormalized to sum
  to one (Mixtral's top-2 rule), so the router gets a gradient as in a real run;
* each expert is a full SwiGLU MLP applied to a gathered copy of its tokens; its output is
  scaled by the gate and added back into the token's row.

Expert parallelism (:func:`shard_experts`) keeps ``experts / ep`` experts on a rank and moves
the routed copies with two ``all_to_all_single`` over the EP group, dispatch and combine, as
torchtitan and Megatron-Core do; their autograd sends the gradients back the same way, so a
step makes four all-to-alls per MoE block.  Balanced routing makes every split equal, the
static shapes fake tensors need.

The load-balancing auxiliary loss is left out: its state is a few numbers per token and expert.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoplace.errors import BenchmarkError


def balanced_choice(tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """Expert index of each token's ``top_k`` choices, ``(tokens, top_k)``, perfectly balanced.

    Tokens are split into ``experts`` contiguous chunks; chunk ``c`` picks experts
    ``c, c+1, ..., c+top_k-1`` (mod ``experts``): distinct per token, and every expert is
    picked by exactly ``top_k`` chunks.

    Raises:
        BenchmarkError: ``experts`` does not divide ``tokens`` (the balance would not be exact).
    """
    if tokens % experts:
        raise BenchmarkError(f"experts({experts}) must divide the tokens of a micro-batch ({tokens}) "
                             "for an exactly balanced routing")
    chunk = torch.arange(tokens) // (tokens // experts)
    return (chunk[:, None] + torch.arange(top_k)) % experts


def expert_slots(tokens: int, experts: int, top_k: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, choice slot) pairs that :func:`balanced_choice` sends to ``expert``.

    In slot ``i`` the expert is chosen by chunk ``expert - i``: the inverse of the rule above,
    written out so that no index has a data-dependent size.
    """
    size = tokens // experts
    starts = [((expert - i) % experts) * size for i in range(top_k)]
    token = torch.cat([torch.arange(start, start + size) for start in starts])
    return token, torch.arange(top_k).repeat_interleave(size)


def routed_slots(tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every routed copy's (token, slot), grouped by expert in expert order.

    Experts are laid out on the EP ranks in order, so this is also the order of the
    dispatch's send buffer: rank ``r``'s share is one contiguous, equal-sized chunk.
    """
    pairs = [expert_slots(tokens, experts, top_k, e) for e in range(experts)]
    return torch.cat([t for t, _ in pairs]), torch.cat([s for _, s in pairs])


def by_local_expert(received: torch.Tensor, ep: int, local: int) -> torch.Tensor:
    """Dispatched rows ``(sources x local experts x rows, h)`` -> ``(local, sources x rows, h)``.

    The all-to-all delivers each source rank's rows in one chunk; an expert's GEMM wants its
    rows from every source together.  The copy this makes is the expert's input, which its
    first linear layer keeps for backward (torchtitan's permute does the same).
    """
    return received.view(ep, local, -1, received.shape[-1]).transpose(0, 1).reshape(local, -1, received.shape[-1])


def by_source(outputs: torch.Tensor, ep: int) -> torch.Tensor:
    """Inverse of :func:`by_local_expert`: expert outputs back into one chunk per source rank."""
    local, _, h = outputs.shape
    return outputs.view(local, ep, -1, h).transpose(0, 1).reshape(-1, h)


class Experts(nn.Module):
    """The experts one rank holds, applied to equal-sized row groups ``(experts, rows, h)``.

    One module so that FSDP2 shards and gathers a block's local experts as one unit, over
    the expert-data-parallel group (torchtitan's ``GroupedExperts``).
    """

    def __init__(self, mlps: list[nn.Module]) -> None:
        super().__init__()
        self.mlps = nn.ModuleList(mlps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([mlp(x[i]) for i, mlp in enumerate(self.mlps)])


class MoEFeedForward(nn.Module):
    """Router plus routed experts (Mixtral); the experts are built by the caller.

    Args:
        hidden: model width (the router's input).
        experts: one module per expert, each mapping ``(n, hidden) -> (n, hidden)``.
        top_k: experts per token.
    """

    def __init__(self, hidden: int, experts: list[nn.Module], top_k: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, len(experts), bias=False)
        self.experts = Experts(experts)
        self.top_k = top_k
        self.ep_group: Any = None  # a ProcessGroup once shard_experts has run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        n, e = flat.shape[0], self.router.out_features
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        gates = probs.gather(1, balanced_choice(n, e, self.top_k).to(x.device))
        gates = (gates / gates.sum(dim=-1, keepdim=True)).to(x.dtype)
        token, slot = (t.to(x.device) for t in routed_slots(n, e, self.top_k))
        routed = self._run_experts(flat[token], e)
        out = torch.zeros_like(flat).index_add_(0, token, routed * gates[token, slot, None])
        return out.view_as(x)

    def _run_experts(self, rows: torch.Tensor, experts: int) -> torch.Tensor:
        """Expert outputs for ``rows`` (grouped by expert), through the EP group when there is one."""
        if self.ep_group is None:
            return self.experts(rows.view(experts, -1, rows.shape[-1])).flatten(0, 1)
        from torch.distributed._functional_collectives import all_to_all_single

        ep, local = experts // len(self.experts.mlps), len(self.experts.mlps)
        received = all_to_all_single(rows, None, None, self.ep_group)
        outputs = self.experts(by_local_expert(received, ep, local))
        return all_to_all_single(by_source(outputs, ep), None, None, self.ep_group)


def shard_experts(moe: MoEFeedForward, group: Any) -> None:
    """Keep only this rank's ``experts / ep`` experts (rank ``r`` of the EP group holds the
    ``r``-th contiguous slice, as torchtitan's ``Shard(0)`` and Megatron-Core lay them out)
    and route through ``group``.

    Raises:
        BenchmarkError: the group size does not divide the experts.
    """
    import torch.distributed as dist

    experts, ep = moe.router.out_features, group.size()
    if experts % ep:
        raise BenchmarkError(f"ep({ep}) must divide experts({experts})")
    local = experts // ep
    start = dist.get_rank(group) * local
    moe.experts = Experts(list(moe.experts.mlps)[start:start + local])
    moe.ep_group = group
