"""torchtitan 0.2.2's own ConfigManager accepts every emitted TOML, and its ParallelDims the degrees;
the model it would train is the plan's (name, flavor, and the shapes torchtitan builds from them).

``import torchtitan`` imports triton (absent on CPU machines), so the package is entered
through a bare stand-in module whose path is torchtitan's: ``torchtitan.config`` and
``torchtitan.distributed.parallel_dims`` import without it (ECOSYSTEM.md).  The llama3 model
package imports triton only through the MoE kernels module, which a stand-in replaces.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, given, settings

from autoplace.bundle import emit
from autoplace.cost.layers import layer_table
from autoplace.emit._common import model_parts
from autoplace.errors import EmitError, SpecError
from autoplace.frameworks import get, torchtitan
from autoplace.frameworks.schema import TORCH_PP_SCHEDULES, TORCHTITAN_FIELDS, TORCHTITAN_SECTIONS
from autoplace.frameworks.torchtitan import (
    LLAMA3_FLAVORS,
    emit_torchtitan,
    plan_from_torchtitan,
    torchtitan_model,
    torchtitan_model_module,
    torchtitan_toml,
)
from autoplace.plan import V_PLACED, Plan
from autoplace.specs.model import load_model
from tests.helpers import REPO, gpu_cluster
from tests.test_emit_plans import CLUSTER16, LAYERS, MODEL, build, make_plan, plan_values, small_model

pytest.importorskip("torch", reason="torchtitan needs torch")
pytest.importorskip("tyro", reason="torchtitan's config manager needs tyro")
_SPEC = importlib.util.find_spec("torchtitan")
if _SPEC is None or not _SPEC.submodule_search_locations:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
TITAN = Path(list(_SPEC.submodule_search_locations)[0])


@contextlib.contextmanager
def without_triton() -> Iterator[None]:
    """torchtitan imported without triton (ECOSYSTEM.md) by the dry run's shim, which stands in for the
    one module that imports it (autoplace.frameworks._torchtitan_dry.import_torchtitan); sys.modules
    restored after."""
    from autoplace.frameworks._torchtitan_dry import import_torchtitan

    saved = {k: v for k, v in sys.modules.items() if k == "torchtitan" or k.startswith("torchtitan.")}
    try:
        import_torchtitan()
        yield
    finally:
        for key in [k for k in sys.modules if k == "torchtitan" or k.startswith("torchtitan.")]:
            del sys.modules[key]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def titan() -> Any:
    """torchtitan's config and ParallelDims modules, imported without the package's triton import."""
    with without_triton():
        from torchtitan.config.job_config import JobConfig
        from torchtitan.config.manager import ConfigManager
        from torchtitan.distributed import pipeline_parallel
        from torchtitan.distributed.parallel_dims import ParallelDims
        from torchtitan.models import llama3

        yield types.SimpleNamespace(ConfigManager=ConfigManager, JobConfig=JobConfig, ParallelDims=ParallelDims,
                                    llama3=llama3, pipeline_parallel=pipeline_parallel)


def parse(titan: Any, plan: Plan, tmp_path: Path, model=MODEL, cluster=CLUSTER16) -> Any:
    """The JobConfig torchtitan's ConfigManager builds from the emitted TOML, degrees checked by ParallelDims."""
    path = tmp_path / "job.toml"
    path.write_text(torchtitan_toml(emit_torchtitan(plan, model, cluster), "generated for a test"))
    job = titan.ConfigManager().parse_args(["--job.config_file", str(path)])
    p = job.parallelism
    titan.ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                       cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                       ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=plan.world)
    return job


def trained_model_params(titan: Any, job: Any, bundle: Path | None = None) -> int:
    """Parameters of the model torchtitan's trainer would build for ``job`` (on the meta device).

    As ``Trainer.__init__`` does: import ``experimental.custom_import`` (from ``bundle``), look the
    flavor up in the train spec's model args, apply the job's sequence length.
    """
    import copy

    import torch

    flavors = titan.llama3.llama3_args
    saved = dict(flavors)
    try:
        if job.experimental.custom_import:
            assert bundle is not None
            source = (bundle / f"{job.experimental.custom_import}.py").read_text()
            exec(compile(source, job.experimental.custom_import, "exec"), {})
        assert job.model.name == "llama3"
        args = copy.deepcopy(flavors[job.model.flavor])
        args.update_from_config(job)
        with torch.device("meta"):
            return sum(p.numel() for p in titan.llama3.Transformer(args).parameters())
    finally:
        flavors.clear()
        flavors.update(saved)


def check_job(job: Any, plan: Plan) -> None:
    assert (job.model.name, job.model.flavor) == ("llama3", "autoplace")  # MODEL is none of torchtitan's flavors
    assert job.experimental.custom_import == "autoplace_torchtitan_model"
    p, t = job.parallelism, job.training
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree,
            p.context_parallel_degree, p.pipeline_parallel_degree) == (plan.dp_replicate, plan.dp_shard, plan.tp,
                                                                         plan.cp, plan.pp)
    # torchtitan's own arithmetic: accumulation = global / (local * dp); PP micro-batches = local / microbatch
    accumulation = t.global_batch_size // (t.local_batch_size * plan.dp)
    micro = p.pipeline_parallel_microbatch_size if plan.pp > 1 else t.local_batch_size
    assert micro == plan.mbs
    assert accumulation * (t.local_batch_size // micro) == plan.grad_accum
    assert t.seq_len == MODEL.seq_len and t.mixed_precision_param == "bfloat16"
    assert job.activation_checkpoint.mode in ("none", "selective", "full")
    if plan.pp > 1:
        from torch.distributed.pipelining.schedules import get_schedule_class

        get_schedule_class(p.pipeline_parallel_schedule)


PLANS = ["zero=3", "zero=2,recompute=full", "zero=3,preset=hsdp,recompute=selective", "tp=2,zero=3",
         "tp=4,cp=2,zero=3", "pp=2,zero=3,mbs=2", "pp=4,vpp=2,zero=2,layers=2:2:2:2",
         "pp=2,zero=3,layers=3:5,schedule=gpipe", "zero=3,offload_optimizer=cpu,offload_params=cpu",
         "zero=0", "cp=2,zero=2,recompute_layers=n:f:n:f:n:f:n:f"]


@pytest.mark.parametrize("text", PLANS)
def test_torchtitan_config_manager_accepts_emitted_toml(text: str, titan, tmp_path) -> None:
    plan = make_plan(text, MODEL, CLUSTER16)
    check_job(parse(titan, plan, tmp_path), plan)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much,
                                                                 HealthCheck.function_scoped_fixture])
@given(values=plan_values(tp=(1, 2), pp=(1, 2, 4), cp=(1, 2), zero=(0, 2, 3), vpp=True, schedules=("1f1b", "gpipe")))
def test_torchtitan_accepts_every_expressible_plan(titan, tmp_path, values) -> None:
    plan = build(values)
    assume(plan is not None)
    try:
        emit_torchtitan(plan, MODEL, CLUSTER16)
    except EmitError:
        assume(False)
    check_job(parse(titan, plan, tmp_path), plan)


def _torchtitan_generator():
    """torchtitan 0.2.2's generate_llm_fqn_per_model_part, compiled alone from its source.

    Its module imports triton through the MoE kernels; the function itself is plain Python.
    """
    source = (TITAN / "distributed" / "pipeline_parallel.py").read_text()
    fn = next(n for n in ast.parse(source).body
              if isinstance(n, ast.FunctionDef) and n.name == "generate_llm_fqn_per_model_part")
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "pipeline_parallel.py", "exec"), namespace)
    return namespace["generate_llm_fqn_per_model_part"]


def build_titan_pipeline(titan: Any, plan: Plan, model: Any) -> list[int]:
    """Run torchtitan 0.2.2's own ``pipeline_llm`` -- the stage count checks, its module split and
    ``build_pipeline_schedule`` with the schedule class it names -- on the job autoplace writes for
    ``plan`` (its [parallelism] and [training] sections, written whether or not the check refuses).

    Stand-ins replace what needs a process group: the mesh, and ``pipeline_module_split``, which
    gets torchtitan's module names per stage and returns pipeline rank 0's stages (one per chunk
    it holds, as the real split's loop style does).  Returns the layers of each chunk; raises
    what torchtitan raises.
    """
    job = titan.JobConfig()
    for key, value in torchtitan.parallelism_section(plan).items():
        setattr(job.parallelism, key, value)
    for key, value in torchtitan.training_section(plan, model).items():
        setattr(job.training, key, value)
    chunks: list[int] = []
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble, get_schedule_class

    def split(whole: Any, mesh: Any, schedule: str, device: Any, names: list[list[str]]) -> Any:
        chunks.extend(sum(n.startswith("layers.") for n in stage) for stage in names)
        # rank 0 of a looped schedule: stages 0, pp, 2 pp, ...; of a V-shaped one at two a rank (torchtitan's
        # style "v" for the classes it names): 0 and 2 pp - 1
        v_style = get_schedule_class(schedule) in (ScheduleZBVZeroBubble, ScheduleDualPipeV)
        indices = (0, len(names) - 1) if v_style and len(names) == 2 * plan.pp else range(0, len(names), plan.pp)
        stages = [types.SimpleNamespace(num_stages=len(names), group_size=plan.pp, group_rank=0, stage_index=i,
                                        is_first=i == 0, is_last=i == len(names) - 1, submod=None) for i in indices]
        return stages, [types.SimpleNamespace() for _ in stages]

    dims = types.SimpleNamespace(pp=plan.pp, get_mesh=lambda name: None)
    with mock.patch.object(titan.pipeline_parallel, "pipeline_module_split", split):
        titan.pipeline_parallel.pipeline_llm(None, dims, job, None, types.SimpleNamespace(n_layers=model.layers),
                                             lambda part, *args: part, lambda *args: None)
    return chunks


# (model global batch, plan) on CLUSTER16: micro-batches per step below, at and above the stage count,
# 1F1B, GPipe and interleaved, stages per rank the schedule takes and does not
SCHEDULE_PLANS = [(8, "pp=2,zero=3"), (8, "tp=2,pp=2,zero=3"), (8, "pp=4,zero=3"), (8, "tp=2,pp=4,zero=3"),
                  (8, "pp=4,zero=3,schedule=gpipe"), (8, "pp=2,zero=3,layers=3:5"), (16, "pp=4,zero=3,mbs=2"),
                  (72, "pp=4,vpp=2,zero=3"), (72, "pp=4,vpp=2,zero=3,mbs=2"), (72, "tp=2,pp=4,vpp=2,zero=3"),
                  (8, "pp=2,vpp=2,zero=3"), (64, "pp=2,vpp=2,zero=3,schedule=1f1b"),
                  (64, "pp=2,zero=3,schedule=interleaved"),
                  # the zero-bubble schedules (issue 38): whole rounds, two chunks in a V, a split off the V
                  (72, "pp=4,vpp=2,zero=3,schedule=interleaved-zb"), (64, "pp=2,vpp=4,zero=3,schedule=interleaved-zb"),
                  (72, "pp=4,vpp=2,zero=3,mbs=2,schedule=interleaved-zb"), (8, "pp=2,zero=3,schedule=interleaved-zb"),
                  (64, "pp=2,vpp=2,zero=3,schedule=zbv"), (72, "pp=4,vpp=2,zero=3,schedule=zbv"),
                  (64, "pp=2,vpp=2,zero=3,schedule=zbv,layers=2:6"), (64, "pp=2,vpp=4,zero=3,schedule=zbv"),
                  # DualPipeV: ZB-V's V, and as many micro-batches as its stages (2 pp)
                  (64, "pp=2,vpp=2,zero=3,schedule=dualpipev"), (72, "pp=4,vpp=2,zero=3,schedule=dualpipev"),
                  (64, "pp=2,vpp=2,zero=3,schedule=dualpipev,layers=2:6"),
                  (16, "pp=2,vpp=2,zero=3,schedule=dualpipev")]


@pytest.mark.parametrize("batch, text", SCHEDULE_PLANS)
def test_torchtitan_builds_the_pipeline_of_every_plan_its_check_admits(batch: int, text: str, titan) -> None:
    """The framework's check (what the search asks) admits a pipeline plan exactly when torchtitan's own
    pipeline_llm and schedule builder accept its job; a refused plan is refused with their rule."""
    model = small_model(batch=batch)
    plan = make_plan(text, model, CLUSTER16)
    why = get("torchtitan").plan_check(model)(plan)
    if why is None:
        chunks = build_titan_pipeline(titan, plan, model)
        assert chunks == torchtitan.stage_parts(plan)
        # and each rank holds the plan's layers where torch places its stages (looped, or a V for ZBV)
        from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping
        style = "v" if plan.schedule in V_PLACED else "loop"
        rank_of = generate_stage_to_rank_mapping(plan.pp, len(chunks), style=style)
        held = [sum(n for s, n in enumerate(chunks) if rank_of[s] == r) for r in range(plan.pp)]
        assert held == list(plan.layers_per_stage)
    else:
        assert why.startswith("torchtitan: ") and ("stage" in why or "rounds" in why), why
        with pytest.raises(ValueError, match="microbatches|stage"):
            build_titan_pipeline(titan, plan, model)


def test_the_405b_plan_the_issue_found_is_refused_with_torchtitans_rule() -> None:
    """Issue 34: Llama-3.1-405B on 2,048 x 8 H100, 1F1B, pp=4, local batch 2, micro-batch 1."""
    model, cluster = load_model(REPO / "tests/data/hf/llama-3.1-405b.json"), gpu_cluster(16384)
    plan = make_plan("tp=8,pp=4,zero=2,mbs=1", model, cluster)
    assert plan.grad_accum == 2
    with pytest.raises(EmitError, match="1F1B with 2 micro-batch\\(es\\) per step on 4 stages"):
        emit_torchtitan(plan, model, cluster)


@pytest.mark.parametrize("text", ["pp=2,zero=3", "pp=4,zero=3", "pp=2,vpp=2,zero=3", "pp=4,vpp=2,zero=2"])
def test_uniform_split_is_what_torchtitans_own_splitter_makes(text: str) -> None:
    plan = make_plan(text, MODEL, CLUSTER16)
    par = emit_torchtitan(plan, MODEL, CLUSTER16)["parallelism"]
    per, stages = par["pipeline_parallel_layers_per_stage"], plan.pp * plan.vpp
    assert -(-LAYERS // per) == stages  # torchtitan: ceil((layers + less_first + less_last) / per)
    chunks = _torchtitan_generator()(stages, LAYERS, par["pipeline_parallel_first_stage_less_layers"],
                                     par["pipeline_parallel_last_stage_less_layers"])
    assert [sum(n.startswith("layers.") for n in c) for c in chunks] == model_parts(plan, "torchtitan")


@pytest.mark.parametrize("stages, first, last", [(2, 1, 1), (4, 1, 1), (4, 0, 2), (3, 2, 0), (8, 0, 0)])
def test_reader_splits_layers_as_torchtitan_does(stages: int, first: int, last: int) -> None:
    from autoplace.frameworks._torchtitan_read import _torchtitan_split

    chunks = _torchtitan_generator()(stages, LAYERS, first, last)
    assert _torchtitan_split(stages, LAYERS, first, last, "t") == [sum(n.startswith("layers.") for n in c)
                                                                    for c in chunks]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize("text", ["pp=2,zero=3,layers=3:5,offload_optimizer=cpu,offload_params=cpu",
                                  "zero=3,recompute_layers=n:f:n:f:n:f:n:f",
                                  "tp=2,cp=2,zero=2,recompute=selective,compile=true,fused_loss=true",
                                  "zero=3,compile=true,fp8=rowwise", "tp=2,zero=3,compile=true,fused_loss=true,"
                                  "tp_overlap=async"])
def test_overrides_are_the_same_job_for_torchtitans_command_line(text: str, titan, tmp_path) -> None:
    """torchtitan_overrides.sh, sourced by bash, gives words torchtitan 0.2.2's own ConfigManager parses
    into the job the TOML describes, field by field (list options are one comma-joined word)."""
    import dataclasses

    plan = make_plan(text, MODEL, CLUSTER16)
    emit(plan, MODEL, CLUSTER16, ["torchtitan"], tmp_path)
    words = subprocess.run(["bash", "-c", 'source torchtitan_overrides.sh && printf "%s\\0" "${TORCHTITAN_OVERRIDES[@]}"'],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    from_cli = dataclasses.asdict(titan.ConfigManager().parse_args(words))
    from_toml = dataclasses.asdict(titan.ConfigManager().parse_args(["--job.config_file",
                                                                     str(tmp_path / "torchtitan.toml")]))
    for section, fields in from_toml.items():
        if section != "job":  # the TOML's own path is its only difference
            for name, value in fields.items():
                assert from_cli[section][name] == value, f"{section}.{name}"


def test_torchtitans_own_flavors_are_the_shapes_autoplace_matches(titan) -> None:
    import torch

    for flavor, (dim, layers, heads, kv_heads, ffn, vocab, theta) in LLAMA3_FLAVORS.items():
        args = titan.llama3.llama3_args[flavor]
        assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size, args.rope_theta) == (
            dim, layers, heads, kv_heads, vocab, theta)
        with torch.device("meta"):
            block = titan.llama3.Transformer(dataclasses_replace(args, n_layers=1)).layers["0"]
        assert block.feed_forward.w1.out_features == ffn


def dataclasses_replace(obj: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **changes)


@pytest.mark.parametrize("path, flavor", [("tests/data/hf/llama-3.1-8b.json", "8B"),
                                          ("tests/data/hf/llama-3.1-70b.json", "70B"),
                                          ("examples/models/llama-3-405b.json", "405B")])
def test_llama31_models_train_torchtitans_own_flavor(path: str, flavor: str, titan, tmp_path) -> None:
    """torchtitan's llama3 flavors are Llama 3.1: same shapes and its RoPE scaling (factor 8)."""
    model, cluster = load_model(REPO / path), gpu_cluster(64)
    plan = make_plan("tp=8,pp=2,zero=3", model, cluster)
    job = parse(titan, plan, tmp_path, model, cluster)
    assert (job.model.name, job.model.flavor, job.experimental.custom_import) == ("llama3", flavor, "")
    assert (job.parallelism.tensor_parallel_degree, job.parallelism.pipeline_parallel_degree,
            job.parallelism.data_parallel_shard_degree) == (8, 2, 4)
    assert job.training.global_batch_size == model.training.global_batch and job.training.seq_len == model.seq_len
    assert torchtitan_model_module(plan, model, cluster) == ""
    if flavor == "8B":  # building the others on the meta device takes longer and proves nothing more
        assert trained_model_params(titan, job) == layer_table(model).params


def test_llama3_without_rope_scaling_gets_a_flavor_without_it(titan) -> None:
    """Llama 3 8B has Llama 3.1 8B's shapes but no RoPE scaling: a custom flavor with factor 1
    (torchtitan's llama3 always applies RoPEScalingArgs; its 8B flavor would scale by 8)."""
    model, cluster = load_model(REPO / "examples/models/llama-3-8b.json"), gpu_cluster(64)
    assert model.rope_scaling is None
    plan = make_plan("tp=8,zero=3", model, cluster)
    source = torchtitan_model_module(plan, model, cluster)
    scope: dict[str, Any] = {}
    saved = dict(titan.llama3.llama3_args)
    try:
        exec(compile(source, "flavor", "exec"), scope)
        args = titan.llama3.llama3_args["autoplace"]
    finally:
        titan.llama3.llama3_args.clear()
        titan.llama3.llama3_args.update(saved)
    assert args.rope_scaling_args.scaling_factor == 1.0 and titan.llama3.llama3_args["8B"].rope_scaling_args.scaling_factor == 8.0
    assert (args.dim, args.n_layers, args.rope_theta) == (4096, 32, 500000.0)


@pytest.mark.parametrize("extra", [{}, {"kv_heads": 8, "ffn_hidden": 688, "rope_theta": 500000}])
def test_a_custom_model_is_registered_with_its_exact_shapes(extra: dict[str, Any], titan, tmp_path) -> None:
    """torchtitan builds, from the bundle's flavor module, a model with autoplace's parameter count."""
    model = small_model(**extra)
    plan = make_plan("tp=2,zero=3", model, CLUSTER16)
    emit(plan, model, CLUSTER16, ["torchtitan"], tmp_path)
    job = titan.ConfigManager().parse_args(["--job.config_file", str(tmp_path / "torchtitan.toml")])
    assert (job.model.name, job.model.flavor) == ("llama3", "autoplace")
    assert trained_model_params(titan, job, tmp_path) == layer_table(model).params
    assert titan.llama3.llama3_args.get("autoplace") is None  # the registry was restored


@pytest.mark.parametrize("path, arch", [("tests/data/hf/mistral-7b-v0.1.json", "sliding-window attention"),
                                        ("tests/data/hf/qwen2.5-0.5b.json", "q/k/v biases"),
                                        ("tests/data/hf/gpt2.json", "linear-layer biases")])
def test_architectures_torchtitan_lacks_are_not_written(path: str, arch: str, tmp_path) -> None:
    model, cluster = load_model(REPO / path), gpu_cluster(16)
    with pytest.raises(EmitError, match=f"not written: {arch}"):
        torchtitan_model(model)
    plan = make_plan("zero=3", model, cluster)
    emit(plan, model, cluster, None, tmp_path)
    assert not (tmp_path / "torchtitan.toml").exists()
    assert f"(not written) torchtitan: {arch}" in (tmp_path / "README.txt").read_text()


def test_key_lists_match_torchtitan(titan) -> None:
    import dataclasses

    sections = {f.name: f for f in dataclasses.fields(titan.JobConfig)}
    assert set(sections) == TORCHTITAN_SECTIONS
    for name, known in TORCHTITAN_FIELDS.items():
        assert {f.name for f in dataclasses.fields(sections[name].default_factory())} == known


def test_schedule_names_are_torchs() -> None:
    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in TORCH_PP_SCHEDULES:
        get_schedule_class(name)


def test_what_torchtitan_cannot_express_raises() -> None:
    for text, message in [("zero=1", "optimizer-only"), ("tp=2,sp=false,zero=3", "sequence parallelism"),
                          ("cp=2,zero=0", "always shards"), ("zero=3,recompute_layers=f:n:n:f:n:n:n:n", "N-th")]:
        with pytest.raises(EmitError, match=message):
            emit_torchtitan(make_plan(text, MODEL, CLUSTER16), MODEL, CLUSTER16)
    with pytest.raises(EmitError, match="fp16"):
        emit_torchtitan(make_plan("zero=3", small_model("fp16"), CLUSTER16), small_model("fp16"), CLUSTER16)


def test_reader_checks_what_torchtitan_leaves_unchecked() -> None:
    base = {"parallelism": {"data_parallel_shard_degree": 16}, "training": {"seq_len": 512},
            "model": {"name": "llama3", "flavor": "autoplace"}, "experimental": {"custom_import": "m"}}
    bad = [({"activation_checkpoint": {"mode": "partial"}}, "activation_checkpoint.mode: 'partial' is not valid"),
           ({"parallelism": {"data_parallel_shard_degree": 4}}, r"!= the cluster's 16 GPUs"),
           ({"parallelism": {"data_parallel_shard_degree": 8, "pipeline_parallel_degree": 2,
                             "pipeline_parallel_schedule": "LoopedBFS"}}, "pipeline_parallel_schedule"),
           ({"training": {"seq_len": 4096}}, "differs from the model's seq_len 512"),
           ({"trainer": {}}, "trainer: unknown key; did you mean 'training'")]
    for patch, message in bad:
        with pytest.raises(SpecError, match=message):
            plan_from_torchtitan({**base, **patch}, MODEL, CLUSTER16)


# ---------------------------------------------------------------------------------------
# Compression: torchtitan 0.2.2 runs none of the options


def test_torchtitan_declares_only_fp32_reduction_so_bf16_is_refused(titan, tmp_path) -> None:
    """Why COMPRESSIONS["bf16"] leaves torchtitan out: 0.2.2's job config declares
    training.mixed_precision_reduce as Literal["float32"]; its command line refuses bfloat16
    (only the TOML loader would pass the string through unchecked)."""
    import typing

    hints = typing.get_type_hints(titan.JobConfig().training.__class__)
    assert typing.get_args(hints["mixed_precision_reduce"]) == ("float32",)
    with pytest.raises(SystemExit):
        titan.ConfigManager().parse_args(["--training.mixed_precision_reduce", "bfloat16"])
    model = small_model("bf16-fsdp2")  # FSDP2's recipe reduces in fp32: bf16 would halve its bytes
    for text in ["zero=3,compress=bf16", "zero=3,compress=zeropp", "dp_replicate=16,zero=0,compress=powersgd"]:
        with pytest.raises(EmitError, match="torchtitan: compress=.*; plan with compress=none"):
            emit_torchtitan(make_plan(text, model, CLUSTER16), model, CLUSTER16)
    plan = make_plan("zero=3", model, CLUSTER16)
    assert parse(titan, plan, tmp_path).training.mixed_precision_reduce == "float32"


def test_reader_refuses_a_bf16_reduction_torchtitan_does_not_declare() -> None:
    plan = make_plan("zero=3", MODEL, CLUSTER16)
    doc = emit_torchtitan(plan, MODEL, CLUSTER16)
    doc["training"]["mixed_precision_reduce"] = "bfloat16"
    with pytest.raises(SpecError, match="'bfloat16' is not valid; valid: float32"):
        plan_from_torchtitan(doc, MODEL, CLUSTER16)
    doc["training"]["mixed_precision_reduce"] = "float32"
    assert plan_from_torchtitan(doc, MODEL, CLUSTER16) == plan.replace(sp=False)
