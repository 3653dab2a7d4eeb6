"""Small builders shared by the reference tests (no fixtures: explicit calls read better)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import yaml

from autoplace.cost.layers import layer_table
from autoplace.evaluation import Evaluation, evaluate
from autoplace.plan import build_plan, parse_plan_string
from autoplace.specs.cluster import ClusterSpec, cluster_from_dict
from autoplace.specs.model import ModelSpec, model_from_dict
from benchmarks.chaos import processes_naming

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "reference"  # copies of ../shared/reference, with their citations


def reference(name: str) -> Any:
    return yaml.safe_load((REFERENCE / name).read_text())


def gpu_cluster(gpus: int, gpu: str = "a100-sxm4-80gb", per_node: int = 8, intra: str = "nvlink3",
                inter: str = "ib-hdr") -> ClusterSpec:
    nodes = max(1, gpus // per_node)
    return cluster_from_dict({"name": f"{nodes}x{min(gpus, per_node)}", "nodes": nodes,
                              "gpus_per_node": min(gpus, per_node), "gpu": gpu, "intra_node": intra,
                              "inter_node": inter})


def gpt_model(layers: int, hidden: int, heads: int, *, vocab: int = 51200, seq: int = 2048, batch: int = 512,
              precision: str = "fp16", **extra: Any) -> ModelSpec:
    """A Megatron-style GPT (4h GeLU MLP, layernorm, biases, learned positions, tied, dropout)."""
    return model_from_dict({
        "name": f"gpt-{layers}x{hidden}", "layers": layers, "hidden": hidden, "ffn_hidden": 4 * hidden,
        "heads": heads, "vocab": vocab, "seq_len": seq, "ffn": "gelu", "norm": "layernorm", "bias": True,
        "tied_embeddings": True, "position": "learned", "dropout": True, "flash_attention": False,
        "training": {"global_batch": batch, "precision": precision, "optimizer": "adam"}, **extra})


def score(model: ModelSpec, cluster: ClusterSpec, plan: str) -> Evaluation:
    table = layer_table(model)
    p = build_plan(parse_plan_string(plan), world=cluster.gpus, blocks=table.blocks,
                   global_batch=model.training.global_batch, gpus_per_node=cluster.gpus_per_node)
    return evaluate(model, cluster, p)


def survivors(text: str, timeout: float = 40.0) -> list[int]:
    """The processes naming ``text`` still alive after waiting up to ``timeout`` seconds for them
    to exit (a bound on waiting, generous for slow machines); they are then SIGKILLed."""
    deadline = time.time() + timeout
    while (left := processes_naming(text)) and time.time() < deadline:
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left


def cpsat_and_oracle(problem: Any) -> tuple[Any, Any]:
    """The CP-SAT and exhaustive results of ``problem``, after checking they agree: the same
    status and, when plans exist, the same optimum (the contract every search change must keep)."""
    import pytest

    from solvers.problem import Budget, objective_key
    from solvers.registry import get_solver

    a = get_solver("cpsat").solve(problem, Budget(time_limit_s=300))
    b = get_solver("exhaustive").solve(problem, Budget(time_limit_s=300))
    assert a.status == b.status
    if b.plans:
        best = [objective_key(r.plans[0], problem.objective)[0] for r in (a, b)]
        assert best[0] == pytest.approx(best[1], rel=1e-6)
    return a, b
