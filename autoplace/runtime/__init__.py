"""The benchmark runtime: real torch.distributed training steps of a plan.

This package is the only place autoplace imports torch (DESIGN.md: torch stays off the solve
path).  :mod:`autoplace.runtime.spec` is torch-free (scaling a model, describing a run) so the
tuner can import it; :mod:`autoplace.runtime.worker` is the program torchrun launches::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m autoplace.runtime.worker --plan-json plan.json --model-json model.json --out run.json
"""
