"""Rack-scale NVLink (issue 13): clusters whose NVLink domain is wider than a node (GB200 NVL72,
72 GPUs over 18 trays of 4) cost TP/CP/EP groups that span trays at NVLink speed, let the search
use them, and reject a domain that is not whole nodes in one line."""

from __future__ import annotations

import json
from pathlib import Path

from autoplace.specs.cluster import cluster_from_dict, load_cluster
from solvers.problem import Problem
from solvers.space import enumerate_configs
from tests.helpers import gpt_model, score
from tests.test_cli import MODELS, invoke

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "gb200-nvl72x2.yaml"


def _trays(domain: int):
    """16 GB200 GPUs on four 4-GPU trays, one NVLink domain of ``domain`` GPUs."""
    return cluster_from_dict({"name": f"gb200-domain{domain}", "nodes": 4, "gpus_per_node": 4, "gpu": "gb200-186gb",
                              "intra_node": "nvlink5", "inter_node": "ib-ndr", "nvlink_domain": domain})


def test_a_tp_group_across_two_trays_runs_at_nvlink_speed_inside_the_domain() -> None:
    """TP=8 spans two 4-GPU trays: the same bytes, far less time when both trays share the domain."""
    model = gpt_model(8, 4096, 32, seq=2048, batch=64, precision="bf16")
    plan = "tp=8,pp=1,dp=2,mbs=1,recompute=none"
    rack, trays = score(model, _trays(16), plan), score(model, _trays(4), plan)
    assert rack.comm["tp"] == trays.comm["tp"] > 0
    assert rack.time["tp"] < 0.6 * trays.time["tp"]  # 0.090 s against 0.178 s per step when written
    assert not any(v.rule == "tp-within-node" for v in rack.violations)
    assert any(v.rule == "tp-within-node" for v in trays.violations)


def test_the_search_may_place_tp_wider_than_a_tray_within_the_domain() -> None:
    model = gpt_model(8, 4096, 32, seq=2048, batch=64, precision="bf16")
    assert 8 in {c.tp for c in enumerate_configs(Problem(model, _trays(16)))}
    assert max(c.tp for c in enumerate_configs(Problem(model, _trays(4)))) == 4


def test_a_domain_that_is_not_whole_nodes_is_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text(EXAMPLE.read_text().replace("nvlink_domain: 72", "nvlink_domain: 70"))
    result = invoke("solve", MODELS / "tiny-llama.json", bad)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "nvlink_domain" in lines[0] and "gpus_per_node" in lines[0]


def test_the_example_rack_cluster_loads_and_solves() -> None:
    cluster = load_cluster(EXAMPLE)
    assert cluster.gpus == 144 and cluster.nvlink_domain == 72
    result = invoke("solve", MODELS / "llama-3-8b.json", EXAMPLE, "--global-batch", "1152", "--json",
                    "--time-limit", "600")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plans"][0]
    assert plan["violations"] == [] and plan["frameworks"] and plan["degrees"]["dp"] * plan["degrees"]["tp"] * \
        plan["degrees"]["pp"] * plan["degrees"]["cp"] == 144
