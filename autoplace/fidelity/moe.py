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

The load-balancing auxiliary loss is left out: its state is a few numbers per token and expert.
"""

from __future__ import annotations

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
        self.experts = nn.ModuleList(experts)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        n, e = flat.shape[0], len(self.experts)
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        gates = probs.gather(1, balanced_choice(n, e, self.top_k).to(x.device))
        gates = (gates / gates.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            token, slot = (t.to(x.device) for t in expert_slots(n, e, self.top_k, i))
            out.index_add_(0, token, expert(flat[token]) * gates[token, slot, None])
        return out.view_as(x)
