"""Read an emitted FSDP2 module (``fsdp2_parallelize.py``) back into a Plan: its plan constants.

The module states the data and tensor parallel degrees, the ZeRO level, offload, compression and
each block's recompute as module-level constants; they are read with :mod:`ast` (the module is
never imported or run).  The batch is the model file's, as the module states none.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from autoplace.errors import SpecError
from autoplace.plan import count_at
from autoplace.specs._io import one_line, read_text
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

_NAMES = ("MODEL_NAME", "DP_REPLICATE", "DP_SHARD", "TP", "SEQUENCE_PARALLEL", "ZERO", "OFFLOAD_TO_CPU", "COMPRESS",
          "POWERSGD_RANK", "RECOMPUTE")


def fsdp_constants(path: str | Path) -> dict[str, Any]:
    """The plan constants of an emitted FSDP2 module.

    Raises:
        SpecError: the file is not Python, or lacks a constant (not a module autoplace wrote).
    """
    src = str(path)
    text = read_text(path)  # bounded in size, UTF-8
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:  # deep nesting: RecursionError
        raise SpecError(f"cannot read the FSDP2 module ({one_line(str(exc)) or type(exc).__name__})",
                        source=src) from None
    found: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in (*_NAMES, "COMPILE"):
                try:
                    found[name] = ast.literal_eval(node.value)
                except (ValueError, TypeError, RecursionError, MemoryError):  # {[1]: 2}: TypeError
                    raise SpecError("expected a literal value", source=src, field=name) from None
    missing = [n for n in _NAMES if n not in found]
    if missing:
        raise SpecError(f"not an FSDP2 module autoplace wrote: no {', '.join(missing)}", source=src, field=missing[0])
    return found


def fsdp_plan_values(path: str | Path, model: ModelSpec, cluster: ClusterSpec) -> dict[str, Any]:
    """The module's placement as ``build_plan`` values (the global batch is the model file's)."""
    c = fsdp_constants(path)
    src = str(path)
    if c["MODEL_NAME"] != model.name:
        raise SpecError(f"the module was written for {c['MODEL_NAME']!r}, the model file is {model.name!r}",
                        source=src, field="MODEL_NAME")
    for name, minimum in (("DP_REPLICATE", 1), ("DP_SHARD", 1), ("TP", 1), ("ZERO", 0), ("POWERSGD_RANK", 0)):
        count_at(c[name], minimum=minimum, source=src, field=name)
    if not isinstance(c["RECOMPUTE"], (list, tuple)) or any(not isinstance(r, str) for r in c["RECOMPUTE"]):
        raise SpecError(f"expected a list of recompute modes, one per block, got {c['RECOMPUTE']!r}", source=src,
                        field="RECOMPUTE")
    if not isinstance(c["OFFLOAD_TO_CPU"], bool):
        raise SpecError(f"expected True or False, got {c['OFFLOAD_TO_CPU']!r}", source=src, field="OFFLOAD_TO_CPU")
    dp = c["DP_REPLICATE"] * c["DP_SHARD"]
    if dp * c["TP"] != cluster.gpus:
        raise SpecError(f"dp({dp}) * tp({c['TP']}) != the cluster's {cluster.gpus} GPUs", source=src,
                        field="DP_SHARD")
    offload = "cpu" if c["OFFLOAD_TO_CPU"] else "none"
    return {"tp": c["TP"], "dp_replicate": c["DP_REPLICATE"], "dp_shard": c["DP_SHARD"], "sp": c["SEQUENCE_PARALLEL"],
            "zero": c["ZERO"], "offload_optimizer": offload, "offload_params": offload, "compress": c["COMPRESS"],
            "powersgd_rank": c["POWERSGD_RANK"], "recompute": tuple(c["RECOMPUTE"]),
            "compile": c.get("COMPILE") is True}  # modules written before it compile nothing
