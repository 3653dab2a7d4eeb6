"""One contract, every registered framework (as Optuna runs one suite over every sampler).

For each framework: its refusal and its files agree (a plan is admissible exactly when it renders);
the verdict does not depend on micro-batching; a refusal is one line naming the feature; what it
writes it reads back as the same plan; its launch line runs its own entry point with its config.
The plans are drawn by hypothesis from every degree, ZeRO level, schedule, offload, compression,
split and per-layer recompute a 16-GPU cluster allows.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplace.bundle import render
from autoplace.emit.launch import Launch
from autoplace.errors import EmitError, SpecError
from autoplace.frameworks import ANY, FRAMEWORKS, NONE, all_frameworks, check_name, get, read_config
from autoplace.frameworks.base import Framework
from autoplace.frameworks.search import admissible
from autoplace.plan import (
    COMPRESS,
    FP8,
    OFFLOAD,
    RECIPE_DEFAULTS,
    RECIPE_KEYS,
    RECOMPUTE,
    SCHEDULES,
    TP_OVERLAP,
    Config,
    Plan,
)
from tests.test_emit_plans import CLUSTER16, MODEL, small_model

# every plan key a refusal may name, and the words for what is not a key
KEYS = ("tp", "pp", "cp", "ep", "vpp", "sp", "zero", "dp_shard", "dp_replicate", "schedule", "offload_params",
        "offload_optimizer", "compress", "powersgd_rank", "recompute", "mbs", "world size", "stage",
        *RECIPE_KEYS)
FEATURE = re.compile("|".join([rf"\b{k}\b" for k in KEYS] + [r"per-layer recompute", r"recompute", r"CPU offload",
                                                          r"HSDP", r"hpZ", r"fsdp_activation_checkpointing",
                                                          r"middle pipeline stage", r"layers", r"precision"]))


@st.composite
def plans(draw: st.DrawFn, blocks: int = 8, world: int = 16) -> Plan:
    """Any Plan of ``blocks`` layers on ``world`` GPUs, valid or not for a given framework."""
    tp, pp, cp = (draw(st.sampled_from([d for d in (1, 2, 4) if world % d == 0])) for _ in range(3))
    if world % (tp * pp * cp):
        tp, pp, cp = tp, pp, 1
    if world % (tp * pp * cp):
        pp = 1
    dp = world // (tp * pp * cp)
    replicate = draw(st.sampled_from([d for d in (1, 2, dp) if dp % d == 0]))
    ep = draw(st.sampled_from([e for e in (1, 2) if (dp * cp) % e == 0]))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    stages = draw(st.sampled_from(["even", "uneven"])) if pp > 1 else "even"
    per = blocks // pp
    split = [per] * pp if stages == "even" or pp == 1 else [per - vpp, *([per] * (pp - 2)), per + vpp]
    compress = draw(st.sampled_from(COMPRESS))
    recompute = draw(st.sampled_from(["uniform", "first", "any"]))
    if recompute == "uniform":
        modes = (draw(st.sampled_from(RECOMPUTE)),) * blocks
    elif recompute == "first":
        modes = tuple("full" if i < 2 else "none" for i in range(blocks))
    else:
        modes = tuple(draw(st.lists(st.sampled_from(RECOMPUTE), min_size=blocks, max_size=blocks)))
    return Plan(tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=replicate, dp_shard=dp // replicate, vpp=vpp,
                sp=draw(st.booleans()) and tp > 1, zero=draw(st.integers(0, 3)), mbs=draw(st.sampled_from([1, 2])),
                grad_accum=draw(st.sampled_from([1, 4])),
                schedule=("interleaved" if vpp > 1 else draw(st.sampled_from([s for s in SCHEDULES if s != "interleaved"]))),
                offload_optimizer=draw(st.sampled_from(OFFLOAD)), offload_params=draw(st.sampled_from(OFFLOAD)),
                compress=compress, powersgd_rank=2 if compress == "powersgd" else 0, recompute=modes,
                layers_per_stage=tuple(split), compile=draw(st.booleans()), fused_loss=draw(st.booleans()),
                tp_overlap=draw(st.sampled_from(TP_OVERLAP)), overlap=draw(st.booleans()), fp8=draw(st.sampled_from(FP8)))


FRAMEWORK = pytest.mark.parametrize("framework", all_frameworks(), ids=FRAMEWORKS)
MODELS = {"bf16": MODEL, "fp16": small_model("fp16")}
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_the_registry_finds_each_framework_by_name_and_lists_the_valid_ones() -> None:
    assert FRAMEWORKS == ("deepspeed", "megatron", "torchtitan", "fsdp", "accelerate")
    assert all(get(name).name == name for name in FRAMEWORKS)
    with pytest.raises(SpecError, match="unknown framework 'jax'; valid: deepspeed, megatron, torchtitan, fsdp"):
        get("jax")
    check_name(ANY), check_name(NONE)
    with pytest.raises(SpecError, match="valid: any, none, deepspeed"):
        check_name("jax")


@FRAMEWORK
@SETTINGS
@given(plan=plans(), dtype=st.sampled_from(sorted(MODELS)))
def test_admissible_exactly_when_it_renders(framework: Framework, plan: Plan, dtype: str) -> None:
    """The search's verdict (the declaration, without rendering) is the files' verdict: the emitters
    (``files``, without the declaration's guard) write exactly the plans the declaration admits, and
    ``render`` refuses with the declaration's own line."""
    model = MODELS[dtype]
    why = framework.refusal(plan, model)
    try:
        files = framework.files(plan, model, CLUSTER16, Launch())
    except EmitError:
        assert why is not None
        with pytest.raises(EmitError, match=re.escape(why)):
            framework.render(plan, model, CLUSTER16, Launch())
        return
    assert why is None and files


@FRAMEWORK
@SETTINGS
@given(plan=plans())
def test_refusals_are_one_line_naming_the_feature(framework: Framework, plan: Plan) -> None:
    why = framework.refusal(plan, MODEL)
    if why is not None:
        assert why.startswith(f"{framework.name}: ") and "\n" not in why
        assert FEATURE.search(why), why


@FRAMEWORK
@SETTINGS
@given(plan=plans(), other=plans(), mbs=st.sampled_from([1, 2, 4]), ga=st.sampled_from([1, 2, 3, 4]))
def test_only_its_batching_rule_reads_the_micro_batching(framework: Framework, plan: Plan, other: Plan, mbs: int,
                                                         ga: int) -> None:
    """Enumeration judges each shape once, at one micro-batching, and each micro-batching of a shape it
    admits with ``batching_refusal`` (solvers.space): the configuration check never reads the
    micro-batching, the plan check refuses another micro-batching of a plan exactly when
    ``batching_refusal`` does, and that reads only pp, vpp, schedule, mbs and grad_accum."""
    batched = plan.replace(mbs=mbs, grad_accum=ga)
    config, check = framework.config_check(MODEL), framework.plan_check(MODEL)
    assert (config(plan) is None) == (config(batched) is None)
    if check(plan.replace(mbs=1, grad_accum=max(4 * plan.pp, 1))) is None:  # a micro-batching every schedule runs
        assert check(batched) == framework.batching_refusal(batched)
    fields = ("pp", "vpp", "schedule", "mbs", "grad_accum")
    assert framework.batching_refusal(other.replaced({f: getattr(plan, f) for f in fields})) == (
        framework.batching_refusal(plan))
    # a framework without declared rules refuses only what the search never builds: interleaved
    # schedules at micro-batches not a multiple of pp (solvers.space._micro)
    assert framework.batching_rules or framework.batching_refusal(plan) is None or (
        plan.schedule == "interleaved" and plan.grad_accum % plan.pp)


@FRAMEWORK
def test_the_search_filter_is_the_declaration(framework: Framework) -> None:
    """``admissible`` (the solver's configuration filter) asks the framework's own configuration check."""
    ok = admissible([framework], MODEL)
    check = framework.config_check(MODEL)
    for config in (Config(dp_shard=16, zero=3), Config(tp=2, pp=2, dp_shard=4, zero=1, sp=True),
                   Config(cp=2, dp_shard=8, zero=2), Config(pp=4, vpp=2, dp_shard=4, zero=1, schedule="interleaved")):
        plan = config.to_plan((2,) * config.pp if config.pp > 1 else (8,), ("none",) * 8)
        assert ok(config) == (check(plan) is None)


@FRAMEWORK
@SETTINGS
@given(plan=plans())
def test_the_configuration_check_admits_every_plan_the_plan_check_admits(framework: Framework, plan: Plan) -> None:
    """The search filters configurations before it chooses splits and recompute: it must never drop a
    configuration one of whose plans the framework runs."""
    if framework.plan_check(MODEL)(plan) is None:
        assert framework.config_check(MODEL)(plan) is None


@FRAMEWORK
@SETTINGS
@given(plan=plans())
def test_a_degree_it_pins_held_at_another_value_is_refused(framework: Framework, plan: Plan) -> None:
    """The search asks a framework's check only of configurations that hold its pinned degrees
    (search.Admission): it must refuse every other one, also one it would run but for that degree
    (the plan with its pins held, no compression, offload or recipe key on)."""
    check = framework.config_check(MODEL)
    plain = plan.replaced({**RECIPE_DEFAULTS, "compress": "none", "powersgd_rank": 0, "offload_optimizer": "none",
                           "offload_params": "none", **framework.pinned_degrees})
    for key, value in framework.pinned_degrees.items():
        assert check(plain.replaced({key: value + 1})) is not None


@pytest.mark.parametrize("framework", [f for f in all_frameworks() if f.config_fields], ids=lambda f: f.name)
@SETTINGS
@given(plan=plans(), other=plans(), dtype=st.sampled_from(sorted(MODELS)))
def test_the_fields_it_declares_decide_its_configuration_check(framework: Framework, plan: Plan, other: Plan,
                                                               dtype: str) -> None:
    """The search judges a configuration once per value of the fields the framework says its
    configuration check reads (``config_fields``): two plans that agree on them get one verdict,
    whatever else they hold (degrees, interleave, micro-batching, split, recompute)."""
    assert framework.config_fields is not None
    check = framework.config_check(MODELS[dtype])
    alike = other.replaced({name: getattr(plan, name) for name in framework.config_fields})
    assert check(alike) == check(plan)


ROUND_TRIPS = ["zero=3", "tp=2,zero=3,recompute=full", "dp_replicate=2,dp_shard=8,zero=3", "tp=2,pp=2,zero=1,recompute=selective",
               "pp=4,zero=1,vpp=2", "pp=2,zero=1,layers=3:5", "dp_replicate=16,zero=0", "cp=2,zero=2",
               "tp=2,pp=2,zero=1,layers=3:5,recompute_layers=f:n:n:f:n:n:n:n",
               # recipes (issue 24): each framework writes and reads back the keys it states
               "tp=2,zero=3,compile=true,fused_loss=true,tp_overlap=async,fp8=rowwise", "dp_replicate=2,dp_shard=8,zero=3,compile=true",
               "tp=2,zero=1,fused_loss=true,tp_overlap=userbuffers,fp8=delayed", "zero=1,overlap=false", "zero=2,overlap=false",
               "zero=2,fp8=tensorwise", "tp=2,zero=2,fp8=mxfp8,compile=true"]


@FRAMEWORK
@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_what_it_writes_it_reads_back_as_the_same_plan(framework: Framework, text: str, tmp_path) -> None:
    from tests.test_emit_plans import make_plan

    plan = make_plan(text, MODEL, CLUSTER16)
    try:
        files = render(framework.name, plan, MODEL, CLUSTER16)
    except EmitError:
        return
    config = files[0]  # each framework writes its config first
    assert any(config.name.endswith(suffix) for suffix in framework.config_suffixes)
    (tmp_path / config.name).write_text(config.text)
    read = read_config(tmp_path / config.name, MODEL, CLUSTER16)
    assert read.framework == framework.name
    if read.batch_stated:
        assert read.plan == plan
    else:  # the batch is the model file's: mbs and accumulation may be split differently
        assert read.plan.replace(mbs=plan.mbs, grad_accum=plan.grad_accum) == plan


@FRAMEWORK
def test_its_launch_scripts_run_its_program_with_its_config(framework: Framework) -> None:
    """launch_torchrun.sh and job.sbatch run the framework's program (torchrun or its own launcher),
    which names a file of the framework's own bundle: its config, argument file or training script."""
    from tests.test_emit_plans import make_plan

    plan = make_plan("zero=3", MODEL, CLUSTER16)
    own = {f.name for f in framework.render(plan, MODEL, CLUSTER16, Launch())}
    for fmt in ("torchrun", "slurm"):
        (script,) = render(fmt, plan, MODEL, CLUSTER16, Launch(), framework)
        assert any(name in script.text for name in own - {"launch_deepspeed.sh", "launch_accelerate.sh"}), \
            (framework.name, fmt, own)
        for word in framework.program(plan, MODEL, Launch()).words:
            assert word in script.text


@FRAMEWORK
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_training_method_it_has_no_path_for_is_refused_by_name(framework: Framework, method: str, tmp_path) -> None:
    """Fine-tuning: a framework runs PEFT's script (its bundle holds peft_train.py) or refuses the model
    in one line naming training.method; the advice names exactly the frameworks that do run it."""
    from tests.test_emit_plans import make_plan

    model = MODEL.model_copy(update={"training": MODEL.training.model_copy(update={"method": method})})
    assert set(framework.peft_runners) == {f.name for f in all_frameworks() if method in f.methods}
    why = framework.model_refusal(model)
    if method not in framework.methods:
        assert why is not None and why.startswith(f"{framework.name}: training.method {method}: ")
        return
    plan = make_plan("zero=3", model, CLUSTER16)
    names = {f.name for f in framework.render(plan, model, CLUSTER16, Launch())}
    assert "peft_train.py" in names
    config = {"deepspeed": "--deepspeed_config", "accelerate": "--accelerate_config"}[framework.name]
    for kind in ("torchrun", "slurm", "k8s"):  # every launch kind hands the script the framework's config
        (script,) = render(kind, plan, model, CLUSTER16, Launch(), framework)
        assert f'peft_train.py {config} "$AUTOPLACE_BUNDLE"/' in script.text, kind
