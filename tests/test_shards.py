"""FSDP2's dim-0 padding in the cost model (autoplace.cost.shards): the tensors it pads are the model's
parameters, and the padding is what torch's own chunking gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from autoplace.cost import shards
from autoplace.cost.layers import layer_table
from autoplace.cost.shards import Rows
from autoplace.specs.model import load_model
from tests.helpers import REPO

HF = sorted((REPO / "tests" / "data" / "hf").glob("*.json"))


@pytest.mark.parametrize("config", HF, ids=lambda p: p.stem)
def test_the_tensors_are_the_models_parameters(config: Path) -> None:
    """Every block kind's tensors hold its parameters, the edges' theirs (so the padding is of these)."""
    table = layer_table(load_model(config))
    for kind in table.kinds:
        assert sum(r.rows * r.elems for r in kind.rows) == kind.params, kind.name
    for edge in (table.embed, table.head):
        assert sum(r.rows * r.elems for r in edge.rows_tp) == edge.params_tp
        assert sum(r.rows * r.elems for r in edge.rows_rep) == edge.params_rep


@pytest.mark.parametrize("config", ["llama-3.1-8b.json", "phi-3-mini-4k-instruct.json", "qwen3-30b-a3b.json",
                                    "deepseek-v2-lite.json"])
def test_the_adapters_tensors_are_the_adapters(config: str) -> None:
    table = layer_table(load_model(REPO / "tests" / "data" / "hf" / config, overrides={"method": "lora"}))
    for kind in table.kinds:
        assert kind.adapter_rows and sum(r.rows * r.elems for r in kind.adapter_rows) == kind.adapters, kind.name


@pytest.mark.parametrize(("rows", "split", "tp", "n"), [
    (128 * 8, "rows", 8, 2048), (53248, "rows", 8, 1024), (60, "", 1, 8), (16384, "elems", 8, 2048),
    (7, "", 1, 3), (128256, "rows", 4, 96), (64, "", 1, 64)])
def test_padding_is_what_torchs_chunks_give(rows: int, split: str, tp: int, n: int) -> None:
    """FSDP2's ``_chunk_with_empty``: chunk 0 (the largest) is what every rank stores."""
    torch = pytest.importorskip("torch")
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    local = rows // tp if split == "rows" else rows
    stored = _chunk_with_empty(torch.empty(local, 3, device="meta"), n, dim=0)[0].numel()
    table = shards.row_table([[Rows(rows, 3 * (tp if split == "elems" else 1), split)]])
    pad = shards.dim0_padding(table, np.array([tp]), np.array([1]), np.array([n]), np.array([n]))
    assert (local * 3 + pad[0, 0]) / n == stored


def test_stacked_experts_pad_on_dim_0_unless_spread_wider_than_they_are() -> None:
    """Stacked experts (dim 0: 8 experts) pad on dim 0 -- over 3 ranks after EP 2: chunks of 2 of the 4 local
    experts, 6 stored; without EP over 64 ranks, 64 -- unless torchtitan shards them on dim 1 (evenly),
    which it does when efsdp * ep > num_experts (apply_fsdp): EP 2 over 8 more ranks."""
    table = shards.row_table([[Rows(8, 10, "elems", expert=True, stacked=True)]])
    pad = shards.dim0_padding(table, tp=np.array([1, 1, 1]), ep=np.array([2, 1, 2]), shards=np.array([6, 64, 16]),
                              expert_shards=np.array([3, 64, 8]))
    assert pad[:, 0].tolist() == [2 * 10, 56 * 10, 0]


@pytest.mark.parametrize(("n", "more"), [(256, 0.0105), (1024, 0.1158), (2048, 0.2842)])
def test_llama_405b_blocks_at_tp8(n: int, more: float) -> None:
    """Llama-3.1-405B's K and V projections have 128 rows at tp=8: one chunk of 1 row per rank past 128 ways."""
    kind = layer_table(load_model(REPO / "tests" / "data" / "hf" / "llama-3.1-405b.json")).kinds[0]
    pad = shards.dim0_padding(shards.row_table([kind.rows]), np.array([8]), np.array([1]), np.array([n]), np.array([n]))
    assert pad[0, 0] / (kind.params_tp / 8 + kind.params_rep) == pytest.approx(more, abs=5e-5)


@pytest.mark.parametrize("framework", ["torchtitan", "fsdp", "accelerate"])
def test_the_padding_changes_nothing_where_the_search_calls_it_idle(framework: str) -> None:
    """--framework any costs frameworks as one where their behaviours differ only in ones idle on a configuration
    (search.IDLE_BEHAVIOUR): on every configuration the framework runs that the rule calls idle for FSDP2's
    padding, the memory terms with and without it are the same; on the others, some differ (a model whose
    K/V projections and vocabulary no shard group divides)."""
    from autoplace.cost.assumptions import DEFAULT
    from autoplace.cost.terms import stage_terms
    from autoplace.frameworks import get, search
    from autoplace.specs.model import model_from_dict
    from solvers.space import enumerate_configs, to_candidates
    from tests.helpers import gpu_cluster

    model = model_from_dict({"name": "odd", "layers": 4, "hidden": 520, "ffn_hidden": 1400, "heads": 8, "kv_heads": 4,
                             "vocab": 4099, "seq_len": 512, "training": {"global_batch": 16}})
    cluster = gpu_cluster(8)
    configs = list(enumerate_configs(search.problem_for(framework, model, cluster, fixed={}, features={"cp"})))
    costed, assume = get(framework).costing(model, DEFAULT)
    assert assume.fsdp2_dim0_padding
    table = layer_table(costed)
    cand = to_candidates(configs, table)
    padded, even = (stage_terms(table, cluster, cand, costed.training.recipe(), assume.replace(fsdp2_dim0_padding=on))
                    for on in (True, False))
    idle = np.array([search.IDLE_BEHAVIOUR["fsdp2_dim0_padding"](c) for c in configs])
    same = np.array([all(np.array_equal(getattr(padded, f)[i], getattr(even, f)[i])
                         for f in ("state_block", "mem_static", "host_block", "host_static")) for i in range(len(configs))])
    assert idle.any() and (~idle).any()
    assert same[idle].all()
    assert not same[~idle].all()
