"""Routed experts (Mixtral, DeepSeek-MoE): one MoE layer for the runtime and the tracker harness.

The router takes a softmax over all experts in fp32 and keeps the probabilities of the chosen
experts as gates, without renormalizing them (Switch / DeepSeek-V2 / Qwen-MoE's default;
renormalizing would starve the router of gradient at top_k = 1).  There is no capacity
factor: every token reaches its k experts (dropless, as Mixtral and torchtitan).  Shared
experts form one FFN of ``shared_experts`` times the width, the sum of that many experts.

Which experts a token goes to is data; two rules decide it (:attr:`MoE.routing`):

* ``"topk"`` (training): the router's top-k, so a run reproduces one process exactly
  whatever the expert-parallel degree;
* ``"balanced"`` (the tracker harness on fake tensors, where values do not exist and a
  data-dependent split has no static shape): a fixed rule with the outcome the cost model
  assumes, every expert receiving exactly ``tokens * top_k / experts`` routed copies
  (:func:`balanced_choice`).

Either way the routed copies are laid out grouped by expert (``order``, ``counts``) and the
rest of the layer is the same code.  Expert parallelism (``ep_group``, set by
``parallel.apply_ep``) keeps ``experts / ep`` consecutive experts on a rank; routed copies
travel to their expert's rank and back in two autograd-aware all-to-alls (torchtitan,
Megatron-Core), whose backward sends the gradients the same way: four per MoE block and
micro-batch.  Under top-k routing the split sizes go first, in a small all-to-all of
``experts`` int64s; balanced routing knows them.  The load-balancing auxiliary loss is left out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autoplace.errors import BenchmarkError

ROUTINGS = ("topk", "balanced")


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
    """Every routed copy's (token, slot) under balanced routing, grouped by expert in expert order."""
    pairs = [expert_slots(tokens, experts, top_k, e) for e in range(experts)]
    return torch.cat([t for t, _ in pairs]), torch.cat([s for _, s in pairs])


def expert_major(counts: list[list[int]]) -> torch.Tensor:
    """Row indices that reorder rows stored source-major (``counts[s][e]`` rows of local expert
    ``e`` from source rank ``s``) into expert-major order (plain ints: no data-dependent shapes)."""
    starts, at = [], 0
    for row in counts:
        starts.append([at + sum(row[:e]) for e in range(len(row))])
        at += sum(row)
    runs = [torch.arange(starts[s][e], starts[s][e] + counts[s][e])
            for e in range(len(counts[0])) for s in range(len(counts))]
    return torch.cat(runs)


class Experts(nn.ModuleDict):
    """The routed experts a rank holds, keyed by global expert index, applied to their runs of rows.

    One module with a forward, so that FSDP2 gathers a block's local experts as one unit, once
    per forward and backward (torchtitan's ``GroupedExperts``); ``fully_shard`` on a list of the
    experts would gather the group again at every expert.
    """

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:  # type: ignore[override]
        """Every expert in index order on its run of ``rows`` (possibly empty: every expert runs, so
        its gradient is a zero tensor rather than None, as on one process)."""
        experts = sorted(self.items(), key=lambda kv: int(kv[0]))
        return torch.cat([m(part) for (_, m), part in zip(experts, rows.split(counts), strict=True)])


class MoE(nn.Module):
    """Router, routed experts keyed by global expert index, optional shared experts.

    Args:
        hidden: model width (the router's input).
        experts: one module per expert, each mapping ``(n, hidden) -> (n, hidden)``.
        top_k: experts per token.
        shared: the shared experts' FFN, or None.
        routing: ``"topk"`` or ``"balanced"`` (module docstring).
    """

    def __init__(self, hidden: int, experts: list[nn.Module], top_k: int, shared: nn.Module | None = None,
                 routing: str = "topk") -> None:
        super().__init__()
        if routing not in ROUTINGS:
            raise BenchmarkError(f"routing must be one of {', '.join(ROUTINGS)}, but got {routing!r}")
        self.n_experts, self.top_k, self.routing = len(experts), top_k, routing
        self.router = nn.Linear(hidden, len(experts), bias=False)
        self.experts = Experts({str(e): m for e, m in enumerate(experts)})
        self.shared_experts = shared
        self.ep_group: Any = None  # a ProcessGroup once parallel.apply_ep has run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        gates, order, counts = self._route(probs)
        token, slot = order // self.top_k, order % self.top_k
        rows = flat[token]
        done = self.experts(rows, counts) if self.ep_group is None else self._exchange(rows, counts)
        # scale each routed copy by its gate and add it into its token's row: autograd keeps the
        # experts' outputs (for the gates' gradient), as the cost model counts, and nothing else
        out = torch.zeros_like(flat).index_add_(0, token, done * gates[token, slot, None].to(done.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(x.shape)

    def _route(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(gates ``[tokens, k]``, routed-copy indices grouped by expert, copies per expert)."""
        n, e, k = probs.shape[0], self.n_experts, self.top_k
        if self.routing == "balanced":
            token, slot = routed_slots(n, e, k)
            gates = probs.gather(1, balanced_choice(n, e, k).to(probs.device))
            return gates, (token * k + slot).to(probs.device), [n * k // e] * e
        gates, chosen = probs.topk(k, dim=-1)
        order = chosen.flatten().argsort(stable=True)
        return gates, order, torch.bincount(chosen.flatten(), minlength=e).tolist()

    def _exchange(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Send each routed copy to its expert's rank, run the local experts, send the results back.

        Received rows arrive grouped by source rank and are regrouped by local expert before the
        experts run (the copy the experts' first layer keeps), then put back for the return trip.
        """
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        n = dist.get_world_size(self.ep_group)
        local = self.n_experts // n
        mine = [counts[r * local:(r + 1) * local] for r in range(n)]  # [dest rank][its local expert]
        recv = ([mine[dist.get_rank(self.ep_group)]] * n if self.routing == "balanced"
                else self._recv_counts(counts, n, rows.device))
        send_splits, recv_splits = [sum(c) for c in mine], [sum(c) for c in recv]
        got = all_to_all_single_autograd(rows, recv_splits, send_splits, self.ep_group)
        regroup = expert_major(recv).to(rows.device)
        done = self.experts(got[regroup], [sum(r[e] for r in recv) for e in range(local)])
        back = done[regroup.argsort()]  # a gather: index_copy would keep ``done`` for backward
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.ep_group)

    def _recv_counts(self, counts: list[int], n: int, device: torch.device) -> list[list[int]]:
        """``[source rank][local expert]`` rows this rank will receive (top-k routing: ask every source)."""
        send = torch.tensor(counts, dtype=torch.int64, device=device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        return recv.view(n, -1).tolist()
