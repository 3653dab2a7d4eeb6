"""Ring attention for context parallelism: K/V passed around the cp group by send/recv.

Rank ``r`` of a cp group of ``n`` holds the ``r``-th contiguous chunk of the sequence (its
queries, keys and values).  Forward: ``n`` steps; at step ``i`` the rank attends its queries to
the K/V chunk of rank ``r - i`` and passes that chunk on to ``r + 1`` (``n - 1`` sends of
K and V), merging the partial outputs by their log-sum-exp as flash attention merges blocks
(Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Dao 2023 for the merge).
Causality: a chunk from a later rank is masked out whole (it still travels: every chunk must
go round), the rank's own chunk gets the triangular mask.

Backward passes K/V round again (``n - 1`` sends) and with them an accumulator of each chunk's
dK/dV, which starts at the rank after the chunk's owner and reaches the owner after ``n - 1``
hops.  So a block moves ``3 (n - 1)`` chunks of K and V per micro-batch, the cost model's
``cp_bytes = cp_fwd * 3`` (``autoplace.cost.terms``; PyTorch's own ``context_parallel`` only
handles the CUDA SDPA kernels and rotates by all-gather or all-to-all).  The chunks are not
load-balanced (Llama 3's two-chunks-per-rank split is not done); it changes time, not bytes.
Computation is in fp32 with the probabilities recomputed in backward, as flash attention does;
attention dropout is not supported here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any) -> torch.Tensor:
    """Causal attention of this rank's chunk over the whole sequence of ``group``.

    Args:
        q: ``[b, heads, s/cp, d]``; k, v: ``[b, kv_heads, s/cp, d]`` (grouped-query attention
            when kv_heads < heads).

    Returns:
        ``[b, heads, s/cp, d]``, as ``F.scaled_dot_product_attention`` returns it.
    """
    return _RingAttention.apply(q, k, v, group)


def _pass_on(send: torch.Tensor, group: Any) -> torch.Tensor:
    """Send ``send`` to the next rank of the ring and receive the previous rank's tensor."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    works = [dist.isend(send, dist.get_global_rank(group, (rank + 1) % n), group=group),
             dist.irecv(recv, dist.get_global_rank(group, (rank - 1) % n), group=group)]
    for w in works:
        if w is not None:  # None only when this rank is not in the group, which cannot happen here
            w.wait()
    return recv


def _expand(kv: torch.Tensor, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a stacked ``[2, b, kv_heads, s, d]`` chunk, one copy per query head, in fp32."""
    k, v = kv[0].float(), kv[1].float()
    return (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)) if rep > 1 else (k, v)


def _scores(q: torch.Tensor, k: torch.Tensor, diagonal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any) -> torch.Tensor:
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        rep, qf = q.shape[1] // k.shape[1], q.float()
        kv = torch.stack((k, v))
        out, lse = torch.zeros_like(qf), torch.full(q.shape[:-1], float("-inf"), device=q.device)
        for i in range(n):
            if i:
                kv = _pass_on(kv, group)
            if (rank - i) % n > rank:  # a later chunk: masked out whole under causality
                continue
            kk, vv = _expand(kv, rep)
            s = _scores(qf, kk, diagonal=i == 0)
            block_lse = torch.logsumexp(s, dim=-1)
            merged = torch.logaddexp(lse, block_lse)
            out = out * (lse - merged).exp()[..., None] + (s - merged[..., None]).exp() @ vv
            lse = merged
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        rep, qf, do = q.shape[1] // k.shape[1], q.float(), dout.float()
        delta = (do * out.float()).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)

        def grads(kv: torch.Tensor, diagonal: bool) -> torch.Tensor:
            """This rank's queries' share of dK/dV of chunk ``kv`` (adds their dQ share into ``dq``)."""
            kk, vv = _expand(kv, rep)
            p = (_scores(qf, kk, diagonal) - lse[..., None]).exp()
            ds = p * (do @ vv.transpose(-2, -1) - delta) * (q.shape[-1] ** -0.5)
            dq.add_(ds @ kk)
            dk, dv = ds.transpose(-2, -1) @ qf, p.transpose(-2, -1) @ do
            b, h, s, d = dk.shape
            return torch.stack([g.view(b, h // rep, rep, s, d).sum(2) for g in (dk, dv)]).to(kv.dtype)

        kv = torch.stack((k, v))
        own = grads(kv, diagonal=True)
        acc = torch.zeros_like(own)
        for i in range(1, n):
            kv = _pass_on(kv, group)
            acc = _pass_on(acc, group) if i > 1 else acc  # the accumulator travels with its chunk
            if (rank - i) % n < rank:  # an earlier chunk: this rank's queries see all of it
                acc = acc + grads(kv, diagonal=False)
        if n > 1:
            own = own + _pass_on(acc, group)  # the last hop brings each chunk's sum home
        return dq.to(q.dtype), own[0], own[1], None
