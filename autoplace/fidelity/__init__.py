"""Fidelity of the cost model: autoplace's predictions against PyTorch's own trackers (issue 6).

:mod:`autoplace.fidelity.model` builds a Llama-style torch model from a
:class:`~autoplace.specs.model.TransformerSpec` (routed experts from :mod:`autoplace.fidelity.moe`
for MoE specs); :mod:`autoplace.fidelity.trackers` shards it with FSDP2 (optionally on a 2-D HSDP
or DTensor TP mesh, or with expert parallelism) over a fake process group on fake tensors and runs
one training step under ``FSDPMemTracker`` with the byte counter of
:mod:`autoplace.fidelity.counting`; :mod:`autoplace.fidelity.compare` sets the measurement beside
autoplace's evaluation of the same plan.  torch is imported only inside those modules.
"""
