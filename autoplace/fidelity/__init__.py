"""Fidelity of the cost model: autoplace's predictions against PyTorch's own trackers (issue 6).

:mod:`autoplace.fidelity.trackers` builds the runtime's model (:mod:`autoplace.runtime.model`)
on fake tensors, lays out a fake process group and parallelizes the model with the runtime's
appliers (:func:`autoplace.runtime.parallel.parallelize`: FSDP2, optionally on a 2-D HSDP or
DTensor TP mesh, or with expert parallelism), then runs one training step under
``FSDPMemTracker`` with the runtime's byte counter (:mod:`autoplace.runtime.comms`);
:mod:`autoplace.fidelity.compare` sets the measurement beside autoplace's evaluation of the
same plan.  torch is imported only inside those modules.
"""
