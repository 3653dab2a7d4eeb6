"""Synthetic training data: the same global batch whatever the plan (torch)."""

from __future__ import annotations

import torch

from autoplace.errors import BenchmarkError
from autoplace.plan import Plan
from autoplace.specs.model import TransformerSpec


def micro_batch(spec: TransformerSpec, plan: Plan, seed: int, step: int, micro: int, dp_rank: int) -> torch.Tensor:
    """This dp rank's rows of global micro-batch ``micro`` of ``step``: [mbs, seq+1] tokens.

    The generator depends only on (seed, step, micro), never on the plan, so one process with
    ``mbs * dp`` rows sees exactly the union of what ``dp`` ranks see (``verify`` relies on it).
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + micro)
    rows = torch.randint(0, spec.vocab, (plan.mbs * plan.dp, spec.seq_len + 1), generator=g)
    return rows[dp_rank * plan.mbs:(dp_rank + 1) * plan.mbs]


def split_inputs(tokens: torch.Tensor, cp: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``tokens`` [rows, seq+1], cut to this context-parallel rank's chunk.

    Rank r holds positions ``r*seq/cp ..< (r+1)*seq/cp`` (contiguous chunks; Llama 3's CP
    balances the causal work with two chunks per rank, which this runtime does not).

    Raises:
        BenchmarkError: the sequence length is not a multiple of cp.
    """
    seq = tokens.shape[1] - 1
    if seq % cp:
        raise BenchmarkError(f"seq_len({seq}) must be a multiple of cp({cp})")
    chunk = slice(cp_rank * seq // cp, (cp_rank + 1) * seq // cp)
    return tokens[:, :-1][:, chunk], tokens[:, 1:][:, chunk]
