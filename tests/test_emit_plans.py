"""Builders the emitter tests share, and tests of the orchestrator (the bundle and its README).

The other ``test_emit_*`` modules import the builders from here.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st

from autoplace.bundle import emit, render
from autoplace.cost.layers import layer_table
from autoplace.emit.launch import Launch
from autoplace.errors import EmitError, SpecError
from autoplace.plan import Plan, build_plan, parse_plan_string
from autoplace.specs.cluster import ClusterSpec, cluster_from_dict
from autoplace.specs.model import ModelSpec, model_from_dict
from tests.helpers import gpu_cluster

LAYERS = 8


def small_model(precision: str = "bf16", *, name: str = "small-llama", layers: int = LAYERS, batch: int = 64,
                **extra: Any) -> ModelSpec:
    """A small Llama-style model (GQA, SwiGLU) that every degree in the strategies divides."""
    return model_from_dict({"name": name, "layers": layers, "hidden": 256, "ffn_hidden": 512, "heads": 8,
                            "kv_heads": 4, "vocab": 1024, "seq_len": 512,
                            "training": {"global_batch": batch, "precision": precision}, **extra})


def cpu_cluster(world: int) -> ClusterSpec:
    """One host of ``world`` gloo processes (the shipped ``cpu`` profile)."""
    return cluster_from_dict({"name": f"cpu-{world}", "nodes": 1, "gpus_per_node": world, "gpu": "cpu",
                              "intra_node": "loopback"})


def make_plan(text: str, model: ModelSpec, cluster: ClusterSpec) -> Plan:
    return build_plan(parse_plan_string(text), world=cluster.gpus, blocks=layer_table(model).blocks,
                      global_batch=model.training.global_batch, gpus_per_node=cluster.gpus_per_node)


CLUSTER16 = gpu_cluster(16)  # 2 nodes x 8 A100
MODEL = small_model()


@st.composite
def plan_values(draw: st.DrawFn, *, tp: tuple[int, ...] = (1, 2, 4), pp: tuple[int, ...] = (1, 2, 4),
                cp: tuple[int, ...] = (1,), zero: tuple[int, ...] = (0, 1, 2, 3), vpp: bool = False,
                schedules: tuple[str, ...] = ("1f1b",), recompute: str = "uniform",
                offload: tuple[str, ...] = ("none",), hsdp: bool = True, sp: bool | None = None,
                compress: tuple[str, ...] = ("none",)) -> dict[str, Any]:
    """Values for ``build_plan`` on CLUSTER16 / MODEL; the caller narrows them to what a format states."""
    v: dict[str, Any] = {"tp": draw(st.sampled_from(tp)), "pp": draw(st.sampled_from(pp)),
                         "cp": draw(st.sampled_from(cp)), "zero": draw(st.sampled_from(zero)),
                         "mbs": draw(st.sampled_from((1, 2)))}
    if sp is not None:
        v["sp"] = sp
    if hsdp and draw(st.booleans()):  # an explicit replicate x shard split of the data-parallel ranks
        dp = CLUSTER16.gpus // (v["tp"] * v["pp"] * v["cp"])
        v["dp_replicate"] = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if dp % d == 0]))
        v["dp_shard"] = dp // v["dp_replicate"]
    if vpp and v["pp"] > 1 and draw(st.booleans()):
        v["vpp"] = 2
    else:
        v["schedule"] = draw(st.sampled_from(schedules))
    if recompute == "uniform":
        v["recompute"] = draw(st.sampled_from(("none", "selective", "full")))
    elif recompute == "per-layer":
        v["recompute_layers"] = ":".join(draw(st.lists(st.sampled_from("nsf"), min_size=LAYERS, max_size=LAYERS)))
    off = draw(st.sampled_from(offload))
    if off != "none" and v["zero"] >= 1:
        v["offload_optimizer"] = off
        if v["zero"] == 3:
            v["offload_params"] = off
    v["compress"] = draw(st.sampled_from(compress))
    if v["compress"] == "powersgd":
        v["powersgd_rank"] = draw(st.sampled_from((1, 2, 4)))
    return v


def build(values: dict[str, Any], model: ModelSpec = MODEL, cluster: ClusterSpec = CLUSTER16) -> Plan | None:
    """The plan, or None when the values make no plan for this world and batch."""
    try:
        return build_plan(values, world=cluster.gpus, blocks=layer_table(model).blocks,
                          global_batch=model.training.global_batch, gpus_per_node=cluster.gpus_per_node)
    except SpecError:
        return None


# ---------------------------------------------------------------------------------------
# The orchestrator


def test_bundle_writes_every_expressible_format_and_a_readme_line_each(tmp_path) -> None:
    plan = make_plan("zero=3,mbs=2,recompute=full,sp=false", MODEL, CLUSTER16)
    written = emit(plan, MODEL, CLUSTER16, None, tmp_path)
    readme = (tmp_path / "README.txt").read_text().splitlines()
    assert set(written) >= {"ds_config.json", "launch_deepspeed.sh", "accelerate_config.yaml", "launch_accelerate.sh",
                            "fsdp2_parallelize.py", "torchtitan.toml", "torchtitan_overrides.sh",
                            "autoplace_torchtitan_model.py", "launch_torchrun.sh", "job.sbatch", "pytorchjob.yaml"}
    assert list(written)[-1] == "README.txt"  # the list of what was written, itself written last
    for name, path in written.items():
        assert path.exists() and path.name == name
        assert sum(line.startswith(f"{name}: ") for line in readme) == (name != "README.txt")
    not_written = [line for line in readme if line.startswith("(not written)")]
    assert not_written == ["(not written) megatron: Megatron-FSDP with a replicated outer group "
                           "(dp_replicate > 1) needs its hybrid-FSDP process groups set up in code; use zero=1 or "
                           "dp_replicate=1"] or len(not_written) <= 1
    assert (tmp_path / "launch_torchrun.sh").stat().st_mode & 0o111


def test_bundle_lists_formats_that_cannot_express_the_plan_with_the_reason(tmp_path) -> None:
    plan = make_plan("tp=2,pp=2,zero=1,vpp=2,recompute=selective", MODEL, CLUSTER16)
    written = emit(plan, MODEL, CLUSTER16, None, tmp_path)
    readme = (tmp_path / "README.txt").read_text()
    assert "megatron_args.sh" in written and "ds_config.json" not in written
    assert "(not written) deepspeed: vpp=2" in readme
    assert "launch_deepspeed.sh" not in written  # the launcher comes with the DeepSpeed config


def test_requested_format_that_cannot_express_the_plan_raises(tmp_path) -> None:
    plan = make_plan("cp=2,zero=1", MODEL, CLUSTER16)
    with pytest.raises(EmitError, match=r"deepspeed: cp=2: DeepSpeed has no ring context parallelism"):
        emit(plan, MODEL, CLUSTER16, ["deepspeed"], tmp_path)
    assert set(emit(plan, MODEL, CLUSTER16, ["megatron", "slurm"], tmp_path)) == {"megatron_args.sh", "job.sbatch",
                                                                                "README.txt"}


def test_unknown_format_is_bad_input_listing_the_valid_ones(tmp_path) -> None:
    plan = make_plan("zero=1", MODEL, CLUSTER16)
    with pytest.raises(SpecError, match="unknown format 'jax'; valid: deepspeed, megatron"):
        emit(plan, MODEL, CLUSTER16, ["jax"], tmp_path)
    with pytest.raises(SpecError):
        render("jax", plan, MODEL, CLUSTER16)


def test_launch_scripts_point_at_the_bundle_directory(tmp_path) -> None:
    plan = make_plan("zero=2", MODEL, CLUSTER16)
    emit(plan, MODEL, CLUSTER16, ["torchrun"], tmp_path / "b")  # by default the script finds its own directory
    assert str(tmp_path) not in (tmp_path / "b/launch_torchrun.sh").read_text()
    emit(plan, MODEL, CLUSTER16, ["torchrun"], tmp_path / "c", launch=Launch(bundle_dir="/shared/job"))
    assert "export AUTOPLACE_BUNDLE=/shared/job" in (tmp_path / "c/launch_torchrun.sh").read_text()


def test_readme_names_the_model_on_one_line_whatever_its_name(tmp_path) -> None:
    model = small_model(name="evil\nname")
    emit(make_plan("zero=2", model, CLUSTER16), model, CLUSTER16, ["torchrun"], tmp_path)
    first = (tmp_path / "README.txt").read_text().splitlines()[0]
    assert first == "autoplace bundle for evil?name on 2x8"


@pytest.mark.parametrize(("precision", "noted", "silent"), [
    ("bf16", {"accelerate_config.yaml", "fsdp2_parallelize.py", "torchtitan.toml"}, {"ds_config.json"}),
    ("bf16-fsdp2", {"ds_config.json"}, {"accelerate_config.yaml", "fsdp2_parallelize.py", "torchtitan.toml"}),
])
def test_bundle_readme_names_the_recipe_each_framework_really_uses(tmp_path, precision: str, noted: set[str],
                                                                   silent: set[str]) -> None:
    """FSDP2 keeps fp32 shards (4 + 4 + 8 B) where ZeRO's bf16 recipe keeps 2 + 2 + 12: the README
    says so beside each file whose framework differs from the recipe the plan was costed with."""
    model = MODEL.model_copy(update={"training": MODEL.training.model_copy(update={"precision": precision})})
    emit(make_plan("zero=3,mbs=2", model, CLUSTER16), model, CLUSTER16, None, tmp_path)
    lines = {line.split(":")[0]: line for line in (tmp_path / "README.txt").read_text().splitlines()}
    assert all(f"costed with training.precision {precision};" in lines[name] for name in noted)
    assert not any("costed with training.precision" in lines[name] for name in silent)


# ---------------------------------------------------------------------------------------
# Compression: each framework runs the options COMPRESSIONS gives it and refuses the others

# a plan each option applies to (autoplace.compression.applies) on CLUSTER16
COMPRESSED = {"bf16": "zero=3,compress=bf16", "zeropp": "zero=3,compress=zeropp",
              "powersgd": "dp_replicate=16,zero=0,compress=powersgd,powersgd_rank=2"}
RUNNERS = {"bf16": {"megatron", "fsdp", "accelerate"}, "zeropp": {"deepspeed"}, "powersgd": {"fsdp"}}


@pytest.mark.parametrize("option", sorted(COMPRESSED))
def test_each_framework_runs_only_the_compressions_it_has(option: str) -> None:
    """The frameworks' declarations agree with what this test states, their files with their
    declarations, and a refusal names the option and compress=none."""
    from autoplace.frameworks import FRAMEWORKS, all_frameworks

    assert {f.name for f in all_frameworks() if option in f.compressions} == RUNNERS[option]
    model = small_model("bf16-fp32-grads") if option == "bf16" else MODEL  # a recipe that reduces in fp32
    plan = make_plan(COMPRESSED[option], model, CLUSTER16)
    for fmt in FRAMEWORKS:
        if fmt in RUNNERS[option]:
            assert render(fmt, plan, model, CLUSTER16)
            continue
        with pytest.raises(EmitError, match=rf"^{fmt}: compress={option}: {fmt} has no configuration for .*; "
                                            "plan with compress=none"):
            render(fmt, plan, model, CLUSTER16)


def test_any_framework_admits_a_compressed_configuration_only_where_one_runs_it() -> None:
    from autoplace.frameworks import all_frameworks
    from autoplace.frameworks.search import admissible
    from autoplace.plan import Config

    ok = admissible(all_frameworks(), MODEL)
    assert ok(Config(dp_shard=16, zero=3, compress="zeropp"))  # DeepSpeed
    assert not ok(Config(dp_shard=8, pp=2, zero=3, compress="zeropp"))  # DeepSpeed's pipeline allows ZeRO-0/1 only
    assert ok(Config(dp_replicate=16, zero=0, compress="powersgd", powersgd_rank=4))  # the FSDP2 module's DDP
    assert not ok(Config(dp_replicate=8, pp=2, zero=0, compress="powersgd", powersgd_rank=4))  # fsdp has no pp
    assert ok(Config(dp_shard=8, pp=2, zero=1, compress="bf16"))  # Megatron --grad-reduce-in-bf16
