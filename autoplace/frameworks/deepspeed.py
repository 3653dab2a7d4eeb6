"""DeepSpeed: its JSON config from a plan (DeepSpeed 0.19 schema, see ECOSYSTEM.md), and its declaration.

Every key written here is one DeepSpeed's own parser reads; the tests feed the result to
``deepspeed.runtime.config.DeepSpeedConfig`` with the plan's data-parallel size and train a
tiny model with it.  What DeepSpeed cannot express (ring context parallelism, interleaved
pipelines, ZeRO-2/3 under its pipeline engine) raises :class:`EmitError`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from autoplace.cost.comm import members_per_domain
from autoplace.emit._common import (
    check_compression,
    fail,
    fp32_grad_accumulation,
    launch_geometry,
    recompute_runs,
    training_dtype,
    uniform_recompute,
)
from autoplace.emit.launch import Launch, exported_names, header, job_environment
from autoplace.errors import SpecError
from autoplace.frameworks.accelerate import PEFT_SCRIPT, peft_checked, peft_files, peft_program
from autoplace.frameworks.base import BundleFile, Framework, PlanCheck, Program, ReadConfig, check_recipe, checked
from autoplace.frameworks.readers import PARTITION_METHOD, bf16_optimizer_shards, deepspeed_split, plan_from_deepspeed
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

if TYPE_CHECKING:
    from autoplace.dryrun.steps import DryContext, Steps

FMT = "deepspeed"
DEFAULT_NVME_PATH = "/local_nvme"  # DeepSpeed's docs' example; the user points it at a real NVMe mount


# a published run's stated DeepSpeed configuration, as the assumptions it sets (run_assumptions)
CONFIG_ASSUMPTIONS = {"reduce_bucket_size": "zero3_reduce_bucket_params",
                      "stage3_prefetch_bucket_size": "zero3_prefetch_bucket_params"}
NON_BLOCKING_OFFLOAD_COPY = (0, 16, 0)  # stage3.py __partition_grads: copy_(..., non_blocking=True) from v0.16.0
# ZeRO-3 before 0.6.0 (partition_parameters.py, stage3.py at v0.3.13-v0.5.10): one list-form reduce-scatter
# per gradient with a Python loop over ranks, a torch.cuda.synchronize() at every module fetch; before
# 0.5.6 each gather in list form too (from 0.5.6 _all_gather_base where torch has it: 1.9 on, not 1.8).  Host
# microseconds per (tensor, rank), those loops restated and timed by benchmarks/deepspeed_host_loops.py
# --legacy on an idle core: gather 2.4; reduce 3.5, 1.9 more than 0.6's coalesced loop timed beside it
# (1.6), so the reduce's is REDUCE_HOST_US plus that difference.
COALESCED_REDUCE = (0, 6, 0)
FETCH_NORMS = (0, 3, 15)  # stage3.py fetch_sub_module formats param.norm() into a debug string, 0.3.15-0.5.10
FLAT_GATHER = (0, 5, 6)
REDUCE_HOST_US = 5.0  # 0.6 on: Assumptions.zero3_reduce_host_us
LEGACY_GATHER_HOST_US, LEGACY_REDUCE_HOST_US = 2.4, round(REDUCE_HOST_US + (3.5 - 1.6), 2)


def run_assumptions(config: Mapping[str, Any]) -> dict[str, Any]:
    """The assumptions a run's stated DeepSpeed configuration sets: its ``reduce_bucket_size``
    and ``stage3_prefetch_bucket_size`` (absolute sizes in place of the h^2 rule autoplace's
    config writes), and its ``version``: from 0.6 to 0.15 a ZeRO-3 backward with an offloaded
    optimizer waits for each gradient bucket (``zero3_offload_grad_copy_blocks``); before 0.6
    ZeRO-3 reduce-scatters each gradient in list form and waits for the device at every fetch
    (from 0.3.15 reading each fetched parameter's norm too), and before 0.5.6 it gathers in list
    form too (``zero3_list_reduces``, ``zero3_fetch_syncs``, ``zero3_fetch_norms``,
    ``zero3_list_gathers``)."""
    unknown = sorted(set(config) - {*CONFIG_ASSUMPTIONS, "version"})
    if unknown:
        raise SpecError(f"framework_config: unknown DeepSpeed key(s) {', '.join(unknown)}; "
                        f"known: {', '.join([*CONFIG_ASSUMPTIONS, 'version'])}")
    out: dict[str, Any] = {name: float(config[key]) for key, name in CONFIG_ASSUMPTIONS.items() if key in config}
    if out:
        out["zero3_buckets_per_hidden_sq"] = 0.0
    if "version" in config:
        try:
            version = tuple(int(x) for x in str(config["version"]).split(".")[:3])
        except ValueError:
            raise SpecError(f"framework_config: version {config['version']!r} is not MAJOR.MINOR[.PATCH]") from None
        version = (*version, 0, 0)[:3]
        # before 0.6 the copy ran non-blocking on its own stream (async_inplace_copy_grad_to_fp32_buffer_from_gpu)
        out["zero3_offload_grad_copy_blocks"] = COALESCED_REDUCE <= version < NON_BLOCKING_OFFLOAD_COPY
        if version < COALESCED_REDUCE:
            out.update(zero3_list_reduces=True, zero3_fetch_syncs=True, zero3_reduce_host_us=LEGACY_REDUCE_HOST_US,
                       zero3_fetch_norms=version >= FETCH_NORMS)
        if version < FLAT_GATHER:
            out.update(zero3_list_gathers=True, zero3_gather_host_us=LEGACY_GATHER_HOST_US)
    return out


def emit_deepspeed(plan: Plan, model: ModelSpec, cluster: ClusterSpec, *,
                   nvme_path: str = DEFAULT_NVME_PATH) -> dict[str, Any]:
    """The DeepSpeed config of ``plan`` as a JSON-ready dict.

    Args:
        plan: the placement; its dp must be world / (tp * pp) (DeepSpeed has no ring CP).
        model: supplies the precision recipe and the hidden size bucket sizes scale with.
        cluster: its NVLink domain sizes ZeRO++'s hpZ groups (compress=zeropp).
        nvme_path: where NVMe offload swaps to (written only when something is offloaded to NVMe).

    Raises:
        EmitError: the plan needs something DeepSpeed cannot configure.
    """
    check_expressible(plan)
    check_split(plan)
    check_precision(plan, training_dtype(model))
    cfg: dict[str, Any] = {
        # DeepSpeed's identity: train_batch_size = micro * accumulation * data-parallel size,
        # with data-parallel size = world / (tp * pp) (runtime/config.py:_batch_assertion).
        "train_batch_size": plan.mbs * plan.grad_accum * plan.dp,
        "train_micro_batch_size_per_gpu": plan.mbs,
        "gradient_accumulation_steps": plan.grad_accum,
    }
    cfg.update(precision_section(model))
    cfg["zero_optimization"] = zero_section(plan, model, nvme_path)
    if plan.compress == "zeropp":
        cfg["zero_optimization"].update(zeropp_keys(plan, cluster))
    if plan.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}  # DeepSpeed AutoTP training
    if plan.ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": plan.ep}
    if any(mode != "none" for mode in plan.recompute):
        cfg["activation_checkpointing"] = activation_checkpointing_section(plan)
    if plan.pp > 1:
        cfg["pipeline"] = pipeline_section(plan)
    return cfg


def check_split(plan: Plan) -> None:
    """Raise EmitError for a pipeline split other than the one DeepSpeed's PipelineModule makes."""
    if plan.pp > 1 and tuple(plan.layers_per_stage) != deepspeed_split(sum(plan.layers_per_stage), plan.pp):
        split = ":".join(map(str, deepspeed_split(sum(plan.layers_per_stage), plan.pp)))
        raise fail(FMT, f"layers {':'.join(map(str, plan.layers_per_stage))}: DeepSpeed's PipelineModule "
                        f"(partition_method {PARTITION_METHOD!r}) balances the blocks as {split} and takes no "
                        "explicit split")


def check_plan(plan: Plan) -> None:
    """Everything DeepSpeed refuses in a plan: :func:`check_expressible` and :func:`check_split`."""
    check_expressible(plan)
    check_split(plan)


def check_precision(plan: Plan, dtype: str) -> None:
    """Raise EmitError for a plan DeepSpeed runs as another in ``dtype`` (bf16, fp16 or fp32)."""
    if bf16_optimizer_shards(plan.zero, plan.pp, plan.dp, dtype):
        raise fail(FMT, f"zero=0 with pp={plan.pp} in bf16: DeepSpeed's pipeline engine runs it with BF16_Optimizer, "
                        f"which shards the fp32 master weights and Adam's state over the {plan.dp} data-parallel ranks "
                        f"(ZeRO-1); use zero=1 with dp_shard={plan.dp}")


def check_expressible(plan: Plan) -> None:
    """Raise EmitError for the parts of ``plan`` DeepSpeed 0.19 has no configuration for."""
    check_compression(plan, FMT, DeepSpeed.compressions)
    check_recipe(plan, DeepSpeed)
    if plan.zero == 0 and not plan.overlap:
        raise fail(FMT, "overlap=false with zero=0: DeepSpeed's overlap_comm is a ZeRO (stage >= 1) setting")
    if plan.compress == "zeropp":
        _check_zeropp(plan)
    if plan.cp > 1:
        raise fail(FMT, f"cp={plan.cp}: DeepSpeed has no ring context parallelism (its sequence_parallel_size "
                        "is Ulysses all-to-all, a different algorithm); use torchtitan or Megatron-LM")
    if plan.vpp > 1:
        raise fail(FMT, f"vpp={plan.vpp}: DeepSpeed's pipeline engine has no interleaved schedule")
    if plan.pp > 1 and plan.schedule != "1f1b":
        raise fail(FMT, f"schedule={plan.schedule}: DeepSpeed's pipeline engine runs 1F1B only")
    if plan.pp > 1 and plan.zero >= 2:
        raise fail(FMT, f"zero={plan.zero} with pp={plan.pp}: DeepSpeed's pipeline engine allows ZeRO-0/1 only")
    if plan.tp > 1 and plan.sp:
        raise fail(FMT, f"sp with tp={plan.tp}: DeepSpeed AutoTP has no Megatron-style sequence parallelism; "
                        "set sp=false")
    if plan.zero == 0 and plan.dp_shard > 1:
        raise fail(FMT, f"dp_shard={plan.dp_shard} with zero=0 shards nothing; use dp_replicate")
    if plan.zero >= 1 and plan.dp_shard == 1 and plan.dp_replicate > 1:
        raise fail(FMT, f"zero={plan.zero} over shard groups of one rank shards nothing, but DeepSpeed would shard "
                        f"over all {plan.dp} data-parallel ranks; use zero=0 or dp_shard > 1")
    if plan.zero in (1, 2) and plan.dp_replicate > 1 and plan.dp_shard > 1:
        raise fail(FMT, f"zero={plan.zero} shards over the whole data-parallel group in DeepSpeed; "
                        f"dp_replicate={plan.dp_replicate} x dp_shard={plan.dp_shard} cannot be expressed")
    if plan.zero == 3 and plan.dp_replicate > 1 and plan.ep > 1:
        raise fail(FMT, "hpZ (dp_replicate > 1 at zero=3) is not supported with AutoEP in DeepSpeed 0.19")
    if plan.zero == 3 and plan.dp_replicate > 1 and plan.tp > 1:
        # deepspeed/utils/groups.py builds hpZ groups from consecutive global ranks: with tp > 1
        # they would mix the tensor-parallel ranks of one layer instead of the shard group
        raise fail(FMT, f"HSDP (dp_replicate={plan.dp_replicate} at zero=3) with tp={plan.tp}: DeepSpeed's hpZ groups "
                        "are consecutive global ranks, which mixes AutoTP ranks; use tp=1 or dp_replicate=1")
    if plan.offload_params != "none" and plan.zero < 3:
        raise fail(FMT, f"offload_params={plan.offload_params} needs zero=3 (DeepSpeed offload_param)")
    if plan.offload_optimizer != "none" and plan.zero < 1:
        raise fail(FMT, f"offload_optimizer={plan.offload_optimizer} needs zero >= 1 (ZeRO-Offload)")
    if uniform_recompute(plan) is None:
        raise fail(FMT, "per-layer recompute: DeepSpeed's activation_checkpointing section says how checkpoints are "
                        "stored, not which layers recompute (the model code decides, alike for every layer); "
                        f"this plan recomputes [{recompute_runs(plan)}]: use none, selective or full for all layers")


def in_dtype(check: Callable[[Plan], None], dtype: str) -> Callable[[Plan], None]:
    """``check``, then :func:`check_precision` in the model's training ``dtype``."""
    def both(plan: Plan) -> None:
        check(plan)
        check_precision(plan, dtype)

    return both


def _check_zeropp(plan: Plan) -> None:
    """ZeRO++ as DeepSpeed 0.19 runs it: stage 3, one shard group, no AutoTP or AutoEP."""
    if plan.zero != 3 or plan.dp_replicate > 1:
        raise fail(FMT, f"compress=zeropp needs zero=3 over the whole data-parallel group (got zero={plan.zero}, "
                        f"dp_replicate={plan.dp_replicate}): DeepSpeed's hpZ is then the secondary shard")
    if plan.tp > 1:
        # deepspeed/utils/groups.py _create_zero_param_parallel_group: hpZ groups are runs of
        # consecutive global ranks, which would mix the tensor-parallel ranks of one layer
        raise fail(FMT, f"compress=zeropp with tp={plan.tp}: DeepSpeed builds hpZ groups from consecutive global "
                        "ranks, which mixes AutoTP ranks; use tp=1 or compress=none")
    if plan.ep > 1:
        raise fail(FMT, f"compress=zeropp with ep={plan.ep}: DeepSpeed 0.19's AutoEP at ZeRO-3 refuses "
                        "zero_quantized_gradients and hpZ (runtime/engine.py); use ep=1 or compress=none")


def zeropp_keys(plan: Plan, cluster: ClusterSpec) -> dict[str, Any]:
    """ZeRO++ (Wang et al. 2023): qwZ int8 weight gathers, hpZ, qgZ int4 gradient reduce-scatter.

    hpZ's secondary shard spans the ZeRO shard group's ranks inside one NVLink domain, the
    group the cost model keeps backward's gathers in (``cost/context.py`` ``group_layout``
    "zero", ``comm.members_per_domain``): gpus_per_node for an 8-GPU node.
    """
    hpz = members_per_domain(np.array(plan.dp_shard * plan.cp), np.array(plan.tp), cluster.nvlink_domain)
    return {"zero_quantized_weights": True, "zero_hpz_partition_size": int(hpz),
            "zero_quantized_gradients": True}


def precision_section(model: ModelSpec) -> dict[str, Any]:
    """bf16 / fp16 blocks from the model's precision recipe (none for fp32 training)."""
    dtype = training_dtype(model)
    out: dict[str, Any] = {}
    if dtype == "bf16":
        out["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        # loss_scale 0 = dynamic loss scaling, starting at 2**16 (DeepSpeed's defaults, written out).
        out["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if dtype != "fp32" and fp32_grad_accumulation(model):
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    return out


def zero_section(plan: Plan, model: ModelSpec, nvme_path: str) -> dict[str, Any]:
    """``zero_optimization``: stage, offloads, overlap and bucket sizes.

    Bucket sizes (in elements) follow the Hugging Face integration's "auto" rules, which
    scale with the hidden size h: reduce/allgather buckets h^2, stage-3 prefetch 0.9 h^2,
    persistence threshold 10 h (transformers ``integrations/deepspeed.py``).
    """
    h = model.hidden
    zero: dict[str, Any] = {"stage": plan.zero}
    if plan.zero == 0:
        return zero
    zero.update({"overlap_comm": plan.overlap, "contiguous_gradients": True,
                 "reduce_bucket_size": h * h, "allgather_bucket_size": h * h})
    if plan.zero == 3:
        zero["stage3_prefetch_bucket_size"] = int(0.9 * h * h)
        zero["stage3_param_persistence_threshold"] = 10 * h
        if plan.dp_replicate > 1:
            # hpZ (ZeRO++, Wang et al. 2023): a secondary parameter shard inside each dp_shard group,
            # so forward/backward all-gathers stay within it, as HSDP's shard group does.
            zero["zero_hpz_partition_size"] = plan.dp_shard
    if plan.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(plan.offload_optimizer, nvme_path)
    if plan.offload_params != "none":
        zero["offload_param"] = _offload(plan.offload_params, nvme_path)
    return zero


def _offload(device: str, nvme_path: str) -> dict[str, Any]:
    out: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def activation_checkpointing_section(plan: Plan) -> dict[str, Any]:
    """``activation_checkpointing``: how DeepSpeed's checkpointing engine stores checkpoints.

    Which layers (or ops) are recomputed is decided where the model calls
    ``deepspeed.checkpointing.checkpoint``; the section sets how: with TP, checkpoints are
    partitioned across the TP group (Megatron-DeepSpeed's ``partition_activations``).  Plans
    reach here with one mode for every layer (:func:`check_expressible` refuses per-layer
    choices), so ``number_checkpoints`` is the layer count.
    """
    return {
        "partition_activations": plan.tp > 1,
        "contiguous_memory_optimization": False,
        "cpu_checkpointing": False,
        "number_checkpoints": sum(mode != "none" for mode in plan.recompute),
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }


def pipeline_section(plan: Plan) -> dict[str, Any]:
    """``pipeline`` with keys DeepSpeed reads (get_pipeline_config, PipelineEngine).

    The stage count and split themselves are arguments of ``PipelineModule(num_stages=...,
    partition_method=...)`` in the user's code; ``stages`` and ``partition`` record them, and the
    plan's split is the one that partition method makes (:func:`emit_deepspeed` refuses others).
    """
    return {
        "stages": plan.pp,
        "partition": PARTITION_METHOD,
        # PipelineModule checkpoints every `interval` layers; 1 = every layer when all recompute fully.
        "activation_checkpoint_interval": 1 if uniform_recompute(plan) == "full" else 0,
    }


CONFIG = "ds_config.json"


class DeepSpeed(Framework):
    """DeepSpeed 0.19: ZeRO 0-3 with offload and ZeRO++, AutoTP, AutoEP, its 1F1B pipeline engine.

    It keeps 16-bit weights and an fp32 master copy (the ZeRO paper's recipe) and all-reduces
    ZeRO-1/2 gradients (stage_1_and_2.py), where the cost model's default reduce-scatters them.
    Its activation checkpointing is the model code's, alike for every layer.
    """

    name = FMT
    title = "DeepSpeed"
    bf16_recipe = "bf16"
    # ZeRO-1/2 all-reduce their buckets; ZeRO-3 gathers module by module and reduce-scatters in
    # buckets, sized as zero_section writes them: reduce h^2, prefetch 0.9 h^2 elements
    # (cost.terms_time.zero3_buckets, zero3_collective_counts and zero3_hidden; DeepSpeed's own
    # defaults, runtime/zero/config.py, are 5e8 and 5e7); zero3_reduce_host_us:
    # reduce_scatter_coalesced's per-(tensor, rank) Python loops, measured by
    # benchmarks/deepspeed_host_loops.py (5.0; see Assumptions.zero3_reduce_host_us).  What it allocates, each
    # measured by its dry run (tests/test_dryrun_deepspeed.py; the sources in cost/assumptions.py):
    # ZeRO-1/2's flat partitions (whole parameters in a ZeRO-2 gradient partition, the offload staging
    # buffers), the fp32 master it clones from fp32 weights (ZeRO-1 to 3), ZeRO-3's gradient partitions from
    # initialize on, the host's 16-bit partition copy under ZeRO-Offload, its reduce_bucket_size buckets
    behaviour = {"zero12_grad_reduce": "all-reduce", "zero3_gather_unit": "module", "zero3_reduce_bucket_params": 5e8,
                 "zero3_prefetch_bucket_params": 5e7, "zero3_buckets_per_hidden_sq": 1.0, "zero3_reduce_host_us": REDUCE_HOST_US,
                 "zero12_flat_partitions": True, "zero_master_clone": True, "zero3_grad_buffer_kept": True,
                 "offload_host_partition_copy": True, "reduce_buckets": "size",
                 "rmsnorm_upcast_kept": True}  # it trains transformers' modelling code (Assumptions.rmsnorm_upcast_kept)
    # LoRA under ZeRO-3: PEFT's fp32 adapters, added after zero.Init, keep their dtype
    method_behaviour = {"lora": {"zero3_adapters_fp32": True}}
    run_assumptions = staticmethod(run_assumptions)
    denied_features = frozenset({"cp", "interleave"})
    layer_recompute = None
    compressions = frozenset({"zeropp"})
    recipes = {"overlap": (True, False)}  # zero_optimization.overlap_comm
    config_suffixes = (".json",)
    config_file = CONFIG
    methods = frozenset({"full", "lora", "qlora"})  # PEFT adapters on the HF model, under accelerate + this config
    reports_hardware_flops = True

    def plan_check(self, model: ModelSpec) -> PlanCheck:
        return checked(peft_checked(in_dtype(check_plan, training_dtype(model)), model, FMT))

    def config_check(self, model: ModelSpec) -> PlanCheck:
        return checked(peft_checked(in_dtype(check_expressible, training_dtype(model)), model, FMT))

    def forced_split(self, blocks: int, pp: int) -> tuple[int, ...] | None:
        return deepspeed_split(blocks, pp)

    def files(self, plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch) -> list[BundleFile]:
        cfg = json.dumps(emit_deepspeed(plan, model, cluster), indent=2) + "\n"
        return [BundleFile(CONFIG, "DeepSpeed config (the launch scripts pass it as --deepspeed_config)", cfg),
                BundleFile("launch_deepspeed.sh", "the deepspeed launcher with ds_config.json, run on the first node",
                           launch_script(plan, model, cluster, launch, self.program(plan, model, launch)),
                           executable=True), *peft_files(plan, model, cluster)]

    def program(self, plan: Plan, model: ModelSpec, launch: Launch) -> Program:
        """The user's script with the config through DeepSpeed's own arguments
        (``deepspeed.add_config_arguments``: ``--deepspeed --deepspeed_config PATH``); for LoRA /
        QLoRA the bundle's PEFT script, which runs accelerate's DeepSpeed plugin on that config."""
        del plan
        peft = peft_program(model, launch, "--deepspeed_config", CONFIG)
        if peft is not None:
            return peft
        q = shlex.quote
        return Program((q(launch.script or "train.py"), "--deepspeed", "--deepspeed_config",
                        f'"$AUTOPLACE_BUNDLE"/{CONFIG}', *(q(a) for a in launch.args), '"$@"'))

    def read(self, path: Path, model: ModelSpec, cluster: ClusterSpec) -> ReadConfig:
        notes: list[str] = []
        plan = plan_from_deepspeed(path, model, cluster, notes=notes)
        return ReadConfig(plan, self.name, True, tuple(notes))

    def dry_run(self, ctx: DryContext, steps: Steps) -> None:
        """DeepSpeed's own setup of the user's script on the fake world (:mod:`._deepspeed_dry`)."""
        if Path(ctx.launched.entry).name == PEFT_SCRIPT:
            from autoplace.frameworks._peft_dry import dry_run as peft_dry_run

            peft_dry_run(ctx, steps, self.name)
            return
        from autoplace.frameworks._deepspeed_dry import dry_run

        dry_run(ctx, steps)


def launch_script(plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch, program: Program) -> str:
    """A bash script for the ``deepspeed`` launcher running the program (which passes the bundle's
    config through ``--deepspeed --deepspeed_config``), in the environment every launch kind sets
    (:func:`~autoplace.emit.launch.job_environment`).  Several nodes need a hostfile (DS_HOSTFILE),
    and the environment reaches the other nodes through DS_ENV_FILE (:func:`remote_environment`)."""
    nodes, per_node = launch_geometry(plan, cluster, "deepspeed-launch")
    lines = header("deepspeed", plan, model, launch) + job_environment(model, cluster, launch, program)
    hostfile = ""
    if nodes > 1:
        hostfile = ' --hostfile "${DS_HOSTFILE:-/job/hostfile}"'
        lines += remote_environment(exported_names(cluster, launch, program))
    lines += [
        f"exec deepspeed --num_nodes {nodes} --num_gpus {per_node}{hostfile} \\",
        f'  --master_addr "${{MASTER_ADDR:-127.0.0.1}}" --master_port "${{MASTER_PORT:-{launch.master_port}}}" \\',
        "  " + " ".join(program.words),
    ]
    return "\n".join(lines) + "\n"


# \ " $ and ` escaped with a backslash: inside double quotes the remote shell reads them literally
_ESCAPE_FOR_DOUBLE_QUOTES = r'  value=${value//\\/\\\\}; value=${value//\"/\\\"}; value=${value//\$/\\\$}; value=${value//\`/\\\`}'


def remote_environment(names: list[str]) -> list[str]:
    """Lines that hand ``names`` (exported variables) to the deepspeed launcher's other nodes.

    Over pdsh the launcher exports on each node only variables whose names start with MLFLOW,
    PYTHON, MV2, UCX or NCCL, and those listed in the file DS_ENV_FILE names, one ``NAME=value`` a
    line (deepspeed 0.19 launcher/runner.py: EXPORT_ENVS, DEEPSPEED_ENVIRONMENT_NAME); it writes a
    value with other characters inside double quotes (multinode_runner.py ``add_export``), so the
    value's backslashes, double quotes, dollars and backquotes are escaped here for that shell.
    """
    return [
        "# the deepspeed launcher hands other nodes only the variables DS_ENV_FILE lists (and NCCL*, PYTHON*)",
        'DS_ENV_FILE=$(mktemp "${TMPDIR:-/tmp}/autoplace-ds-env.XXXXXX")',
        "export DS_ENV_FILE",
        f"for name in {' '.join(names)}; do",
        "  value=${!name}",
        "  if [[ $value == *$'\\n'* ]]; then",
        '    echo "autoplace: $name holds a newline; the deepspeed launcher passes one line per variable" >&2; exit 2',
        "  fi",
        _ESCAPE_FOR_DOUBLE_QUOTES,
        '  printf \'%s=%s\\n\' "$name" "$value" >> "$DS_ENV_FILE"',
        "done",
    ]
