"""Fused attention's speed by kernel, head dim, sequence length and mask, forward and backward.

A GPU profile's ``attention_efficiency`` holds measured rates (fractions of the 16-bit dense
peak, counting the FLOPs the kernel executes) as rows over sequence length: the main rows
(FlashAttention-2, causal, at ``head_dim``) and any number of ``tables`` for other head dims,
masks and kernels.  Here they become one lookup, vectorized over candidates:

* sequence: linear in log(sequence) between measured lengths (the kernels' rates rise as the
  fixed per-tile prologue and the last, partly masked, diagonal block amortize over more key
  blocks); past the longest measured length the rate stays at its value there, the kernel being
  compute-bound (FlashAttention-2, Dao 2023, Fig. 4: +0.0 to +3.8% from 8k to 16k on A100), and
  below the shortest likewise;
* head dim: linear between the two measured head dims that bracket it; outside them, the nearest
  table scaled by :func:`~autoplace.cost.tiles.k_loop_share` ``(d) / k_loop_share(d_table)``,
  never faster (a score's softmax is fixed work beside its ``2 d`` matmul FLOPs, so smaller heads
  run slower; FlashAttention-2 at head dim 256 is no faster than at 128);
* mask: a causal kernel executes half the full ``QK^T`` and ``PV`` FLOPs (Dao 2023, Sec. 4.1, the
  FLOP count of its benchmarks) at its own, lower, rate (its diagonal blocks are partly masked
  and the work per row differs, so short sequences balance worse); where a profile has no
  non-causal rows the causal ones stand in;
* kernel: ``fa2`` (FlashAttention-2, which PyTorch's SDPA flash backend runs), ``fa1``
  (FlashAttention, Dao et al. 2022; the 2022 runs) and ``mem_efficient`` (SDPA's memory-efficient
  backend, xformers' kernel: torch 2.13 ``torch.nn.functional.scaled_dot_product_attention``'s
  docstring names its backends "FlashAttention-2" and "Memory-Efficient Attention", linking
  facebookresearch/xformers), each from its own series in the same benchmark figure (the
  FlashAttention-2 paper's "xformers" bars are its cutlass kernel, Sec. 4.1); a kernel the
  profile does not measure runs as ``fa2``.

Backward executes 2.5x the forward FLOPs (five matmuls against two, the forward's recomputed:
Dao 2023, Sec. 4.1) at its own rate, lower than the forward's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplace.cost.tiles import k_loop_share
from autoplace.specs.cluster import AttentionEfficiency

Array = np.ndarray

FA_BACKWARD_FLOPS = 2.5  # backward / forward FLOPs of flash attention (Dao 2023, Sec. 4.1)


@dataclass(frozen=True)
class _Rows:
    """One measured setting: its head dim and its forward and backward rows as arrays."""

    head_dim: float
    log_seq_fwd: Array
    fwd: Array
    log_seq_bwd: Array
    bwd: Array

    def at(self, x: Array) -> tuple[Array, Array]:
        """Forward and backward fractions at ``x`` = log(sequence), held flat past either end."""
        return np.interp(x, self.log_seq_fwd, self.fwd), np.interp(x, self.log_seq_bwd, self.bwd)


def _rows(head_dim: float, forward: list[list[float]], backward: list[list[float]]) -> _Rows:
    f, b = np.asarray(forward, dtype=float), np.asarray(backward, dtype=float)
    return _Rows(float(head_dim), np.log(f[:, 0]), f[:, 1], np.log(b[:, 0]), b[:, 1])


@dataclass(frozen=True)
class AttentionRates:
    """A GPU's fused-attention rates (:func:`rates_of` builds them from its profile).

    ``settings`` maps (kernel, causal) to that setting's tables, sorted by head dim;
    ``head_overhead`` is the profile's ``head_dim_overhead``.
    """

    settings: dict[tuple[str, bool], tuple[_Rows, ...]]
    head_overhead: float = 0.0

    def fractions(self, seq: Array, head_dim: float, causal: bool = True,
                  kernel: str = "fa2") -> tuple[Array, Array]:
        """Forward and backward fractions of the 16-bit peak at ``seq`` keys, heads of ``head_dim``."""
        tables = (self.settings.get((kernel, causal)) or self.settings.get(("fa2", causal))
                  or self.settings[("fa2", True)])
        x = np.log(np.maximum(np.asarray(seq, dtype=float), 1.0))
        dims = [t.head_dim for t in tables]
        hi = int(np.searchsorted(dims, head_dim))
        if 0 < hi < len(tables):  # between two measured head dims: linear in head dim
            lo_t, hi_t = tables[hi - 1], tables[hi]
            w = (head_dim - lo_t.head_dim) / (hi_t.head_dim - lo_t.head_dim)
            (f0, b0), (f1, b1) = lo_t.at(x), hi_t.at(x)
            return f0 + w * (f1 - f0), b0 + w * (b1 - b0)
        near = tables[min(hi, len(tables) - 1)]
        scale = min(1.0, float(k_loop_share(head_dim, self.head_overhead) / k_loop_share(near.head_dim, self.head_overhead)))
        f, b = near.at(x)
        return f * scale, b * scale

    def seconds(self, flops: Array, seq: Array, peak_flops: float, head_dim: float, causal: bool = True,
                kernel: str = "fa2") -> tuple[Array, Array]:
        """Forward and backward seconds of attention whose full (unmasked) forward costs ``flops``
        on a GPU of ``peak_flops`` (16-bit, sustained)."""
        executed = flops * (0.5 if causal else 1.0)
        fwd, bwd = self.fractions(seq, head_dim, causal, kernel)
        return executed / (peak_flops * fwd), FA_BACKWARD_FLOPS * executed / (peak_flops * bwd)


def rates_of(eff: AttentionEfficiency) -> AttentionRates:
    """The lookup of a profile's ``attention_efficiency``: its main rows (``fa2``, causal, at its
    ``head_dim``) and each of its ``tables``; a later table of the same setting and head dim wins."""
    found: dict[tuple[str, bool], dict[float, _Rows]] = {("fa2", True): {eff.head_dim: _rows(eff.head_dim, eff.forward,
                                                                                               eff.backward)}}
    for t in eff.tables:
        found.setdefault((t.kernel, t.causal), {})[t.head_dim] = _rows(t.head_dim, t.forward, t.backward)
    settings = {key: tuple(by_dim[d] for d in sorted(by_dim)) for key, by_dim in found.items()}
    return AttentionRates(settings, eff.head_dim_overhead)
