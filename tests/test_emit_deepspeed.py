"""DeepSpeed accepts every emitted config, checked by DeepSpeed's own classes, and trains with it.

``DeepSpeedConfig`` asks ``deepspeed.comm`` for the rank and silently falls back to world
size 1 without a process group (ECOSYSTEM.md), so the config module's ``dist`` is replaced
by a stand-in reporting the plan's world size, and an mpu reports its data-parallel size.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings

from autoplace.errors import EmitError, SpecError
from autoplace.frameworks.deepspeed import emit_deepspeed
from autoplace.frameworks.readers import plan_from_deepspeed
from autoplace.frameworks.schema import (
    DEEPSPEED_ACTIVATION_CHECKPOINTING,
    DEEPSPEED_OFFLOAD_OPTIMIZER,
    DEEPSPEED_OFFLOAD_PARAM,
    DEEPSPEED_PIPELINE,
    DEEPSPEED_REMOVED,
    DEEPSPEED_TOP_LEVEL,
    DEEPSPEED_ZERO,
)
from autoplace.plan import Plan
from tests.test_emit_plans import CLUSTER16, MODEL, build, cpu_cluster, make_plan, plan_values, small_model

dsc = pytest.importorskip("deepspeed.runtime.config", reason="deepspeed is not installed")

PLANS = ["zero=0", "zero=1,mbs=2", "zero=2,recompute=selective", "zero=3,recompute=full",
         "zero=3,preset=hsdp", "zero=3,offload_optimizer=cpu,offload_params=cpu",
         "zero=3,offload_optimizer=nvme,offload_params=nvme", "zero=2,offload_optimizer=cpu",
         "tp=2,sp=false,zero=1", "tp=4,sp=false,zero=2,mbs=2", "pp=2,zero=1,recompute=full", "pp=4,zero=1",
         "tp=2,pp=2,sp=false,zero=1"]


class _Dist:
    """deepspeed.comm stand-in: rank 0 of ``world``."""

    def __init__(self, world: int) -> None:
        self.world = world

    def get_rank(self, group: Any = None) -> int:
        return 0

    def get_world_size(self, group: Any = None) -> int:
        return self.world


class _Mpu:
    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def deepspeed_accepts(cfg: dict[str, Any], plan: Plan, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Parse ``cfg`` with DeepSpeedConfig as rank 0 of the plan's world, data-parallel size plan.dp."""
    monkeypatch.setattr(dsc, "dist", _Dist(plan.world))
    return dsc.DeepSpeedConfig(copy.deepcopy(cfg), mpu=_Mpu(plan.dp))


def check_parsed(parsed: Any, cfg: dict[str, Any], plan: Plan) -> None:
    assert parsed.world_size == plan.dp
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (
        plan.mbs * plan.grad_accum * plan.dp, plan.mbs, plan.grad_accum)
    assert parsed.zero_optimization_stage == plan.zero
    zero = parsed.zero_config
    assert (zero.offload_optimizer.device if zero.offload_optimizer else "none") == plan.offload_optimizer
    assert (zero.offload_param.device if zero.offload_param else "none") == plan.offload_params
    hpz = plan.dp_shard if plan.zero == 3 and plan.dp_replicate > 1 else 1
    if plan.compress == "zeropp":  # ZeRO++: hpZ over the node (tp=1 on 8-GPU nodes), int8 weights, int4 gradients
        hpz = min(8, plan.dp_shard)
    assert zero.zero_hpz_partition_size == hpz
    assert zero.zero_quantized_weights == zero.zero_quantized_gradients == (plan.compress == "zeropp")
    assert set(cfg) <= DEEPSPEED_TOP_LEVEL  # nothing DeepSpeed would silently drop


@pytest.mark.parametrize("text", PLANS)
def test_deepspeed_config_class_accepts_emitted_config(text: str, monkeypatch) -> None:
    plan = make_plan(text, MODEL, CLUSTER16)
    cfg = emit_deepspeed(plan, MODEL, CLUSTER16)
    parsed = deepspeed_accepts(cfg, plan, monkeypatch)
    check_parsed(parsed, cfg, plan)
    assert parsed.bfloat16_config.enabled and not parsed.float16_config.enabled
    assert parsed.tensor_parallel_config.autotp_size == (plan.tp if plan.tp > 1 else 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much,
                                                                 HealthCheck.function_scoped_fixture])
@given(values=plan_values(tp=(1, 2, 4), pp=(1, 2), recompute="per-layer", offload=("none", "cpu", "nvme"),
                          sp=False, compress=("none", "zeropp")))
def test_deepspeed_accepts_every_expressible_plan(values, monkeypatch) -> None:
    plan = build(values)
    assume(plan is not None)
    try:
        cfg = emit_deepspeed(plan, MODEL, CLUSTER16)
    except EmitError:
        assume(False)
    check_parsed(deepspeed_accepts(cfg, plan, monkeypatch), cfg, plan)


@pytest.mark.parametrize("precision, enabled", [("fp16", "fp16"), ("fp32", None), ("bf16-fp32-grads", "bf16")])
def test_precision_follows_the_model_recipe(precision: str, enabled: str | None, monkeypatch) -> None:
    model = small_model(precision)
    plan = make_plan("zero=2", model, CLUSTER16)
    parsed = deepspeed_accepts(emit_deepspeed(plan, model, CLUSTER16), plan, monkeypatch)
    assert parsed.float16_config.enabled == (enabled == "fp16")
    assert parsed.bfloat16_config.enabled == (enabled == "bf16")
    assert parsed.grad_accum_dtype == ("fp32" if precision == "bf16-fp32-grads" else None)


def test_zero0_under_a_bf16_pipeline_is_zero1_as_deepspeed_runs_it() -> None:
    """DeepSpeed's pipeline engine trains bf16 at stage 0 with BF16_Optimizer, which shards the fp32 master and
    Adam over data parallelism: the plan is refused naming zero=1, and a config saying stage 0 reads as zero=1
    (its dry run measures BF16_Optimizer's bytes against a zero=1 plan: tests/test_dryrun_deepspeed.py)."""
    plan = make_plan("pp=4,zero=0", MODEL, CLUSTER16)
    with pytest.raises(EmitError, match=r"zero=0 with pp=4 in bf16: .*BF16_Optimizer.*use zero=1 with dp_shard=4"):
        emit_deepspeed(plan, MODEL, CLUSTER16)
    cfg = emit_deepspeed(make_plan("pp=4,zero=1", MODEL, CLUSTER16), MODEL, CLUSTER16)
    cfg["zero_optimization"] = {"stage": 0}
    notes: list[str] = []
    read = plan_from_deepspeed(cfg, MODEL, CLUSTER16, notes=notes)
    assert (read.zero, read.dp_shard, read.dp_replicate) == (1, 4, 1) and any("BF16_Optimizer" in n for n in notes)
    for precision in ("fp16", "fp32"):  # FP16_Optimizer and the bare optimizer keep every state whole
        model = small_model(precision)
        assert emit_deepspeed(make_plan("pp=4,zero=0", model, CLUSTER16), model, CLUSTER16)["zero_optimization"] == {
            "stage": 0}


@pytest.mark.parametrize("per_node, domain, hpz", [(8, None, 8), (4, None, 4), (4, 8, 8), (2, 72, 16)])
def test_zeropp_sets_quantized_weights_and_gradients_and_hpz_over_the_nvlink_domain(
        per_node: int, domain: int | None, hpz: int, monkeypatch) -> None:
    """DeepSpeed's parser reads ZeRO++ back: qwZ, qgZ, and an hpZ group of the ZeRO ranks one NVLink
    domain holds (a node, or a rack-scale domain), the group the cost model keeps backward's gathers in."""
    from autoplace.specs.cluster import cluster_from_dict

    cluster = cluster_from_dict({"name": "c", "nodes": 16 // per_node, "gpus_per_node": per_node,
                                 "gpu": "a100-sxm4-80gb", "intra_node": "nvlink3", "inter_node": "ib-hdr",
                                 **({"nvlink_domain": domain} if domain else {})})
    plan = make_plan("zero=3,compress=zeropp", MODEL, cluster)
    cfg = emit_deepspeed(plan, MODEL, cluster)
    zero = deepspeed_accepts(cfg, plan, monkeypatch).zero_config
    assert (zero.zero_quantized_weights, zero.zero_quantized_gradients, zero.zero_hpz_partition_size) == (
        True, True, hpz)
    assert plan_from_deepspeed(cfg, MODEL, cluster) == plan  # and the reader reads ZeRO++ back


def test_zeropp_is_refused_where_deepspeed_cannot_run_it_as_costed() -> None:
    for text, message in [("zero=2,compress=zeropp", "needs zero=3"), ("zero=3,preset=hsdp,compress=zeropp",
                                                                       "needs zero=3 over the whole"),
                          ("tp=2,sp=false,zero=3,compress=zeropp", "consecutive global ranks"),
                          ("zero=3,compress=bf16", "deepspeed has no configuration for bf16 gradient reduction"),
                          ("dp_replicate=16,zero=0,compress=powersgd", "plan with compress=none")]:
        with pytest.raises(EmitError, match=message):
            emit_deepspeed(make_plan(text, MODEL, CLUSTER16), MODEL, CLUSTER16)


def test_hsdp_with_tensor_parallel_is_refused() -> None:
    """DeepSpeed's hpZ groups are consecutive global ranks (utils/groups.py): with tp > 1 they would
    hold the tensor-parallel ranks of one layer, not the ZeRO shard group the plan was costed with."""
    with pytest.raises(EmitError, match="HSDP .* with tp=2: DeepSpeed's hpZ groups are consecutive"):
        emit_deepspeed(make_plan("tp=2,sp=false,zero=3,dp_replicate=2,dp_shard=4", MODEL, CLUSTER16), MODEL, CLUSTER16)
    emit_deepspeed(make_plan("zero=3,dp_replicate=2,dp_shard=8", MODEL, CLUSTER16), MODEL, CLUSTER16)  # tp=1 runs


def test_reader_refuses_a_partial_or_resized_zeropp() -> None:
    cfg = emit_deepspeed(make_plan("zero=3,compress=zeropp", MODEL, CLUSTER16), MODEL, CLUSTER16)
    for key, value, message in [("zero_quantized_gradients", False, "set both or neither"),
                                ("zero_hpz_partition_size", 4, "one NVLink domain, 8 here; got 4")]:
        bad = copy.deepcopy(cfg)
        bad["zero_optimization"][key] = value
        with pytest.raises(SpecError, match=message):
            plan_from_deepspeed(bad, MODEL, CLUSTER16)


def test_deepspeed_cannot_express_context_parallelism_or_interleaving() -> None:
    for text, message in [("cp=2,zero=1", "ring context parallelism"), ("pp=2,vpp=2,zero=1", "no interleaved"),
                          ("pp=2,zero=2", "ZeRO-0/1 only"), ("tp=2,zero=1", "sequence parallelism"),
                          ("pp=2,zero=1,schedule=gpipe", "1F1B only")]:
        with pytest.raises(EmitError, match=message):
            emit_deepspeed(make_plan(text, MODEL, CLUSTER16), MODEL, CLUSTER16)


# ---------------------------------------------------------------------------------------
# The key lists autoplace checks against, compared with the installed DeepSpeed


def _aliases(model_cls: Any) -> set[str]:
    return {name for n, f in model_cls.model_fields.items() for name in (n, f.alias) if name}


def test_per_layer_recompute_is_refused_not_approximated() -> None:
    """number_checkpoints cannot say which layers; a mixed plan is refused (and kept out of the search)."""
    with pytest.raises(EmitError, match="per-layer recompute: DeepSpeed's activation_checkpointing section"):
        emit_deepspeed(make_plan("zero=2,recompute_layers=f:f:n:n:n:n:n:n", MODEL, CLUSTER16), MODEL, CLUSTER16)
    cfg = emit_deepspeed(make_plan("zero=2,recompute=full", MODEL, CLUSTER16), MODEL, CLUSTER16)
    assert cfg["activation_checkpointing"]["number_checkpoints"] == 8  # every layer
    from autoplace.frameworks import get

    deepspeed = get("deepspeed")  # the search tries each mode on every block, and nothing per layer
    assert (deepspeed.uniform_recompute, deepspeed.layer_recompute) == (("none", "selective", "full"), None)


def test_zero_and_offload_key_lists_match_deepspeed() -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    assert _aliases(DeepSpeedZeroConfig) == DEEPSPEED_ZERO
    assert _aliases(DeepSpeedZeroOffloadParamConfig) == DEEPSPEED_OFFLOAD_PARAM
    assert _aliases(DeepSpeedZeroOffloadOptimizerConfig) == DEEPSPEED_OFFLOAD_OPTIMIZER


def test_activation_checkpointing_and_pipeline_key_lists_match_deepspeed() -> None:
    from deepspeed.runtime.activation_checkpointing import config as ac

    assert set(ac.ACT_CHKPT_DEFAULT) == DEEPSPEED_ACTIVATION_CHECKPOINTING
    assert set(dsc.get_pipeline_config({})) <= DEEPSPEED_PIPELINE


def test_top_level_keys_deepspeed_reads_are_all_known(monkeypatch) -> None:
    """Record every key DeepSpeedConfig looks up; each must be in our list (or a removed feature)."""
    seen: set[str] = set()

    class Recording(dict):
        def get(self, key, *default):
            seen.add(key)
            return super().get(key, *default)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

    plan = make_plan("zero=3,recompute=full", MODEL, CLUSTER16)
    monkeypatch.setattr(dsc, "dist", _Dist(plan.world))
    dsc.DeepSpeedConfig(Recording(emit_deepspeed(plan, MODEL, CLUSTER16)), mpu=_Mpu(plan.dp))
    assert seen - DEEPSPEED_TOP_LEVEL - DEEPSPEED_REMOVED == set()


def test_every_known_top_level_key_is_named_in_deepspeeds_source() -> None:
    import deepspeed

    root = Path(deepspeed.__file__).parent
    text = "\n".join(p.read_text(errors="ignore") for p in root.rglob("*.py"))
    missing = {k for k in DEEPSPEED_TOP_LEVEL if f'"{k}"' not in text and f"'{k}'" not in text}
    assert missing == set()


def test_reader_rejects_a_top_level_key_deepspeed_would_ignore() -> None:
    plan = make_plan("zero=2", MODEL, CLUSTER16)
    cfg = emit_deepspeed(plan, MODEL, CLUSTER16)
    cfg["zero_optimisation"] = cfg.pop("zero_optimization")
    with pytest.raises(SpecError, match="zero_optimisation: unknown key .*did you mean 'zero_optimization'"):
        plan_from_deepspeed(cfg, MODEL, CLUSTER16)


# ---------------------------------------------------------------------------------------
# A real step on 2 gloo ranks


def _train_worker(rank: int, world: int, configs: list[dict[str, Any]], port: int, out: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    import deepspeed

    # The CPU accelerator JIT-builds a shared-memory all-reduce op (~40 s, once per machine) that
    # has nothing to do with the config under test; plain gloo collectives are used instead.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for cfg in configs:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        # A torch optimizer keeps DeepSpeed from JIT-building its fused / CPU Adam; DeepSpeed
        # asks for this one extra top-level key to accept it under ZeRO.
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                          config=dict(cfg, zero_allow_untested_optimizer=True))
        x = torch.randn(cfg["train_micro_batch_size_per_gpu"], 16, generator=torch.Generator().manual_seed(rank))
        y = torch.randint(0, 4, (x.shape[0],), generator=torch.Generator().manual_seed(rank))
        for _ in range(cfg["gradient_accumulation_steps"]):
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
        results.append({"stage": engine.zero_optimization_stage(), "dp": engine.dp_world_size,
                        "steps": engine.global_steps, "loss": loss.item()})
        engine.destroy()
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    # leave together: a rank that tears gloo down while its peer still talks aborts (SIGABRT)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_deepspeed_trains_a_step_with_emitted_zero2_and_zero3_configs(tmp_path) -> None:
    """One launch, 2 gloo ranks on CPU: ZeRO-2 then ZeRO-3, each one optimizer step (~10 s)."""
    mp = pytest.importorskip("torch.multiprocessing")
    model, cluster = small_model("fp32"), cpu_cluster(2)
    model = model.model_copy(update={"training": model.training.model_copy(update={"global_batch": 8})})
    configs = [emit_deepspeed(make_plan(f"zero={z},mbs=2", model, cluster), model, cluster) for z in (2, 3)]
    assert all(c["gradient_accumulation_steps"] == 2 and c["train_batch_size"] == 8 for c in configs)
    mp.spawn(_train_worker, args=(2, configs, _free_port(), str(tmp_path / "out")), nprocs=2)
    for rank in range(2):
        results = json.loads((tmp_path / f"out.{rank}").read_text())
        assert [(r["stage"], r["dp"], r["steps"]) for r in results] == [(2, 2, 1), (3, 2, 1)]
        assert all(r["loss"] == r["loss"] for r in results)  # not NaN


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_pipeline_split_is_the_one_deepspeeds_partition_method_makes() -> None:
    """PipelineModule takes no explicit split: the bundle names the block-balanced partition method,
    refuses any other split, and the reader reads back the split that method makes."""
    from deepspeed.runtime.utils import partition_balanced

    from autoplace.frameworks.readers import PARTITION_METHOD, deepspeed_split

    for blocks, stages in [(8, 3), (30, 4), (48, 4), (61, 8), (126, 16)]:
        weights = [0] + [1] * blocks + [0, 0]  # embedding, the blocks, norm and head
        parts = partition_balanced(weights, stages)
        assert deepspeed_split(blocks, stages) == tuple(sum(weights[a:b]) for a, b in zip(parts[:-1], parts[1:], strict=True))
    model = small_model(layers=10)  # on 4 stages: 3:3:2:2 from DeepSpeed, 2:3:3:2 from autoplace's even split
    plan = make_plan("pp=4,zero=1", model, CLUSTER16)
    assert plan.layers_per_stage != deepspeed_split(10, 4)
    with pytest.raises(EmitError, match=r"layers 2:3:3:2: DeepSpeed's PipelineModule .* balances the blocks as 3:3:2:2"):
        emit_deepspeed(plan, model, CLUSTER16)
    pinned = make_plan("pp=4,zero=1,layers=3:3:2:2", model, CLUSTER16)
    cfg = emit_deepspeed(pinned, model, CLUSTER16)
    assert cfg["pipeline"]["partition"] == PARTITION_METHOD
    assert plan_from_deepspeed(cfg, model, CLUSTER16).layers_per_stage == (3, 3, 2, 2)
    with pytest.raises(SpecError, match="parameter count"):
        plan_from_deepspeed({**cfg, "pipeline": {**cfg["pipeline"], "partition": "parameters"}}, model, CLUSTER16)


def test_check_accepts_the_deepspeed_pipeline_bundle_it_came_from(tmp_path: Path) -> None:
    """Issue 23: Qwen3-30B-A3B's DeepSpeed bundle was costed at 10:13:13:12 and read back as 12:12:12:12.
    DeepSpeed's pipelines are now searched at the split its PipelineModule makes, and check agrees."""
    from tests.helpers import REPO
    from tests.test_cli import invoke

    model, cluster = REPO / "tests/data/hf/qwen3-30b-a3b.json", REPO / "examples/clusters/8x8-h100.yaml"
    out = tmp_path / "b"
    solved = invoke("solve", model, cluster, "--framework", "deepspeed", "--fix", "pp=4", "--out", out,
                    "--time-limit", "10", "--top", "1", "--json")
    assert solved.exit_code == 0, solved.output
    plan = Plan.from_dict(json.loads((out / "plan.json").read_text()))
    assert (plan.pp, plan.layers_per_stage) == (4, (12, 12, 12, 12))
    checked = invoke("check", out / "ds_config.json", model, cluster)
    assert checked.exit_code == 0, checked.output
    assert "layers=12:12:12:12" in checked.output
