"""Fidelity of the cost model: autoplace's predictions against PyTorch's own trackers (issue 6).

:mod:`autoplace.fidelity.trackers` builds a Llama-style torch model from a
:class:`~autoplace.specs.model.TransformerSpec` (routed experts from
:mod:`autoplace.fidelity.moe` for MoE specs), shards it with FSDP2 (and optionally a
2-D HSDP or DTensor TP mesh, or expert parallelism with all-to-all dispatch) over a fake
process group on fake tensors, runs one training
step under ``FSDPMemTracker`` with a collective counter, and sets the measurement beside
autoplace's evaluation of the same plan.  torch is imported only inside those modules.
"""
