"""Clusters from flags (--cluster 4x8xh100, --gpu h100 --nodes 4) and link tiers defaulted
from the GPU profile, in flags and in cluster.yaml alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from autoplace.cli import app
from autoplace.errors import SpecError
from autoplace.specs.cluster import (
    cluster_from_dict,
    cluster_from_flags,
    load_cluster,
    parse_cluster_shorthand,
    profile_names,
)
from autoplace.specs.cluster import load_profile as profile

REPO = Path(__file__).resolve().parents[1]
MODEL = str(REPO / "examples" / "models" / "llama-3-8b.json")
H100_YAML = REPO / "examples" / "clusters" / "8x8-h100.yaml"
A100_YAML = REPO / "examples" / "clusters" / "1x8-a100-80gb.yaml"


def run(*args: str) -> Any:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    doc.pop("solve_seconds", None)
    doc.pop("phases_s", None)  # timings
    doc.get("cluster", {}).pop("name", None)
    return doc


def pools(c: Any) -> Any:
    return [p.model_dump(exclude={"name"}) for p in c.pools]


@pytest.mark.parametrize("flags", [["--cluster", "8x8xh100"], ["--gpu", "h100", "--nodes", "8"],
                                   ["8x8xh100"], ["--cluster", "8xh100-sxm5-80gb"]])
def test_flags_solve_as_the_example_yaml(flags: list[str]) -> None:
    base = ["solve", MODEL, "--json", "--time-limit", "120", "--workers", "1"]  # proved optimal, deterministic
    assert run(*base, *flags) == run(*base, str(H100_YAML))


def test_flags_evaluate_as_the_example_yaml() -> None:
    base = ["evaluate", MODEL, "--plan", "tp=2,zero=1", "--json"]
    assert run(*base, "--cluster", "1x8xa100") == run(*base, str(A100_YAML))


def test_flag_cluster_is_the_yaml_cluster() -> None:
    assert pools(cluster_from_flags("h100", 8)) == pools(load_cluster(H100_YAML))


def test_yaml_without_links_takes_the_profiles_defaults() -> None:
    doc = yaml.safe_load(H100_YAML.read_text())
    for key in ("intra_node", "inter_node", "gpus_per_node"):
        del doc[key]
    assert pools(cluster_from_dict(doc, source="c.yaml")) == pools(load_cluster(H100_YAML))


def test_links_and_sizes_are_overridable() -> None:
    c = cluster_from_flags("h100", 4, gpus_per_node=4, inter_node="roce-400", intra_node="pcie5")
    pool = c.pools[0]
    assert (pool.gpus_per_node, pool.intra_node.name, pool.inter_node.name, c.gpus) == (4, "pcie5", "roce-400", 16)


def test_shorthand_forms() -> None:
    assert parse_cluster_shorthand("4x8xh100") == (4, 8, "h100-sxm5-80gb")
    assert parse_cluster_shorthand("2XA100") == (2, None, "a100-sxm4-80gb")
    for bad in ("4x8", "h100", "4x8xh9000", "x8xh100"):
        with pytest.raises(SpecError):
            parse_cluster_shorthand(bad)


def test_every_profile_default_names_a_shipped_link() -> None:
    links = set(profile_names("interconnect"))
    aliases: list[str] = []
    for name in profile_names("gpu"):
        gpu = profile("gpu", name)
        assert {gpu.default_intra_node, gpu.default_inter_node} - {None} <= links, name
        assert gpu.default_gpus_per_node is not None and "defaults" in gpu.sources, name
        aliases += gpu.aliases
    assert len(aliases) == len(set(aliases))  # one profile per alias


def test_mi300x_nodes_default_to_infinity_fabric_with_cited_numbers() -> None:
    """``--cluster 4x8xmi300x`` needs no link flags: the MI300X profile names the shipped
    xGMI profile (7 links x 64 GB/s per direction, ~75% usable) and NDR InfiniBand, each
    number cited beside it."""
    c = cluster_from_flags("mi300x", 4, gpus_per_node=8)
    pool = c.pools[0]
    assert (c.gpus, pool.intra_node.name, pool.inter_node.name) == (32, "xgmi-mi300x", "ib-ndr")
    xgmi = profile("interconnect", "xgmi-mi300x")
    assert (xgmi.bandwidth_GBps, xgmi.achievable_fraction) == (7 * 64, 0.75)
    assert {"bandwidth_GBps", "latency_us", "achievable_fraction"} <= set(xgmi.sources)
    result = CliRunner().invoke(app, ["evaluate", MODEL, "--cluster", "4x8xmi300x", "--plan", "dp_shard=32", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["cluster"]["gpus"] == 32


def test_multi_node_without_a_known_network_names_the_flag() -> None:
    with pytest.raises(SpecError) as info:
        cluster_from_flags("l40s", 2)  # PCIe servers: no standard NIC, so no default
    assert info.value.field == "inter_node"
    assert cluster_from_flags("l40s", 2, inter_node="roce-200").pools[0].inter_node.name == "roce-200"


@pytest.mark.parametrize(("args", "needle"), [
    (["--cluster", "4x8xh100", "--gpu", "h100"], "not both"),
    ([str(H100_YAML), "--nodes", "2"], "give the cluster once"),
    ([], "a cluster is needed"),
    (["--gpu", "tpu-v5"], "aliases"),
])
def test_bad_cluster_flags_are_one_line(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, ["solve", MODEL, *args])
    assert result.exit_code == 2
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_flag_cluster_round_trips_through_plan_json(tmp_path: Path) -> None:
    tiny = str(REPO / "examples" / "models" / "tiny-llama.json")
    solved = CliRunner().invoke(app, ["solve", tiny, "--cluster", "1x2xcpu", "--time-limit", "3",
                                      "--out", str(tmp_path / "b")])
    assert solved.exit_code == 0, solved.output
    inputs = json.loads((tmp_path / "b" / "plan.json").read_text())["inputs"]
    assert inputs["cluster"] == "1x2xcpu"
    emitted = CliRunner().invoke(app, ["emit", str(tmp_path / "b" / "plan.json"), "--format", "torchrun",
                                       "--out", str(tmp_path / "e")])
    assert emitted.exit_code == 0, emitted.output


def test_every_shipped_alias_names_its_profile() -> None:
    """GPU aliases resolve to the profile that lists them, in any case (only the profiles
    whose text names the alias are parsed)."""
    from autoplace.specs.cluster import gpu_profile_name

    aliases = {alias: name for name in profile_names("gpu") for alias in profile("gpu", name).aliases}
    assert aliases
    for alias, name in aliases.items():
        assert gpu_profile_name(alias) == gpu_profile_name(alias.upper()) == name
