"""The benchmark runtime: real torch.distributed training steps of a plan, and autoplace's one torch stack.

The torch stack -- the model (:mod:`~autoplace.runtime.model`, routed experts in
:mod:`~autoplace.runtime.moe`, ring attention in :mod:`~autoplace.runtime.ring`), the
TP/CP/EP/FSDP appliers (:mod:`~autoplace.runtime.parallel`) and the collective counter
(:mod:`~autoplace.runtime.comms`) -- lives here and is imported by the tracker harness
(:mod:`autoplace.fidelity`), so what the trackers measure is what the runtime trains.  Imports
flow one way: fidelity -> runtime, never back.  torch stays off the solve path.

:mod:`autoplace.runtime.spec` is torch-free (scaling a model, describing a run, naming where a
trial departs from its plan) so the tuner and calibration can import it; :mod:`autoplace.runtime.worker` is the program torchrun launches::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m autoplace.runtime.worker --plan-json plan.json --model-json model.json --out run.json
"""
