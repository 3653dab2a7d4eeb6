"""Published training runs as plans: what they ran, what they measured, what autoplace predicts.

A run file (``tests/reference/published_runs.yaml``) lists measured end-to-end runs, each with
its source, model shape, cluster, framework, precision, plan and options (torch.compile,
async TP, fp8 recipe); :func:`load_runs` turns each into a model, a cluster, a plan (the options
as its recipe keys, :func:`run_recipe`) and the framework's assumptions, and :func:`predict` scores it with the evaluator and compares it with the
measurement in the run's own metric (tokens/s per GPU, MFU, or TFLOP/s per GPU).  A row whose
source reports it out of memory (``measured: {oom: true}``, ``tests/reference/published_oom.yaml``)
loads with the metric ``oom`` and is scored only for whether it fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from autoplace import frameworks
from autoplace.cost.assumptions import DEFAULT, Assumptions
from autoplace.errors import SpecError
from autoplace.evaluation import Evaluation, evaluate
from autoplace.plan import Plan, build_plan
from autoplace.specs._io import read_document
from autoplace.specs.cluster import ATTENTION_KERNELS, ClusterSpec, cluster_from_dict
from autoplace.specs.model import ModelSpec, Precision, model_from_dict

# A multi-node run whose source does not name its network: the usual fabric of its GPU generation.
DEFAULT_NETWORK = {"a100": "ib-hdr", "v100": "ib-hdr", "h100": "ib-ndr", "h200": "ib-ndr", "b200": "ib-ndr"}
INTRA = {"a100": "nvlink3", "v100": "nvlink2", "h100": "nvlink4", "h200": "nvlink4", "b200": "nvlink5"}
# torchtitan's Float8 training keeps FSDP2's fp32 shards and bf16 activations; only the GEMMs run in fp8
FP8_FSDP2 = Precision(name="fp8-fsdp2", param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=2,
                      compute_dtype="fp8", param_comm_bytes=2, grad_comm_bytes=4, master_copy=False)
METRICS = ("tokens_per_s_per_gpu", "mfu", "tflops_per_gpu", "hw_tflops_per_gpu")


@dataclass(frozen=True)
class PublishedRun:
    """One measured run, ready to score."""

    id: str
    source: str
    framework: str
    model: ModelSpec
    cluster: ClusterSpec
    plan: Plan
    assumptions: Assumptions
    metric: str
    measured: float
    family: str
    raw: dict[str, Any]

    @property
    def group(self) -> tuple[str, str, int, float]:
        """Runs of the same model on the same cluster (GPU, count and network per GPU): the pairs a
        ranking compares.  The ZeRO++ post measures one model over four networks; a faster network is
        not a configuration a planner chooses, so those runs are not paired across networks."""
        pool = self.cluster.pools[0]
        return self.model.name, pool.gpu.name, self.cluster.gpus, round(pool.inter_Bps_per_gpu / 1e9, 3)


def gpu_family(profile: str) -> str:
    return profile.split("-")[0]


def _declared(framework: str, what: str, default: Any) -> Any:
    """What a registered framework declares (``what``), else ``default`` (plain DDP runs)."""
    return getattr(frameworks.get(framework), what) if framework in frameworks.FRAMEWORKS else default


def _precision(row: dict[str, Any]) -> str | Precision:
    fsdp = _declared(row["framework"], "bf16_recipe", "bf16") == "bf16-fsdp2"
    if row["precision"] == "fp8":
        return FP8_FSDP2 if fsdp else "fp8"
    if row["precision"] == "fp16":
        return "fp16"
    return "bf16-fsdp2" if fsdp else "bf16"


def _metric(row: dict[str, Any]) -> tuple[str, float]:
    measured = row["measured"]
    for key in METRICS[:3]:
        if measured.get(key):
            # DeepSpeed's and Megatron's TFLOP/s count the recompute forward (hardware FLOPs)
            hardware = key == "tflops_per_gpu" and _declared(row["framework"], "reports_hardware_flops", False)
            return ("hw_tflops_per_gpu" if hardware else key), float(measured[key])
    raise SpecError("no measured throughput", source=row["id"])


def _cluster(row: dict[str, Any]) -> ClusterSpec:
    c = row["cluster"]
    if not c.get("nodes") or not c.get("gpus_per_node"):
        raise SpecError("the run does not say how its GPUs are spread over nodes", source=row["id"])
    family = gpu_family(c["gpu_profile"])
    doc = {"name": f"{c.get('nodes') or 1}x{c['gpus_per_node'] or 8}-{c['gpu_profile']}", "nodes": c.get("nodes") or 1,
           "gpus_per_node": c.get("gpus_per_node") or 8, "gpu": c["gpu_profile"],
           "intra_node": c.get("intra_node") or INTRA.get(family, "nvlink4"),
           "inter_node": c.get("inter_node") or DEFAULT_NETWORK.get(family, "ib-ndr")}
    if c.get("inter_node_Gbps_per_node"):  # a network stated per node, shared by its GPUs (NCCL's NET latency)
        doc["inter_node"] = {"name": f"{c['inter_node_Gbps_per_node']}Gbps-per-node", "latency_us": 14.0,
                             "bandwidth_GBps": c["inter_node_Gbps_per_node"] / 8 / doc["gpus_per_node"]}
    return cluster_from_dict(doc, source=row["id"])


def recompute_layers(row: dict[str, Any], blocks: int) -> str | None:
    """The per-layer recompute a run's activation checkpointing amounts to, where its framework's
    "selective" is not Korthikanti's (attention-core recompute, a no-op with flash attention):

    * torchtitan's layer SAC checkpoints every second block (``selective_ac_option = "2"``, its
      default), and fms-fsdp's ``selective_checkpointing`` a fraction of blocks its runs do not
      state (one in two taken);
    * torchtitan's per-op SAC saves every second matmul's output and attention's, recomputing
      the rest: about a third of the activations of no recompute and half the forward matmuls,
      approximated as two of every three blocks fully recomputed.
    """
    detail = str((row.get("options") or {}).get("ac_detail") or "").lower()
    if (row["plan"].get("recompute") or "none") != "selective":
        return None
    if "op" in detail.replace("option", "").split() or "per op" in detail or "'op'" in detail:
        return ":".join("n" if i % 3 == 2 else "f" for i in range(blocks))
    return ":".join("f" if i % 2 == 0 else "n" for i in range(blocks))


def _plan(row: dict[str, Any], blocks: int, world: int) -> Plan:
    p = row["plan"]
    values: dict[str, Any] = {k: p[k] for k in ("tp", "pp", "cp", "ep", "zero") if p.get(k) is not None}
    values.update(dp_shard=p.get("dp_shard") or 1, dp_replicate=p.get("dp_replicate") or 1, mbs=p.get("mbs") or 1,
                  ga=p.get("ga") or 1)
    layers = recompute_layers(row, blocks)
    if layers:
        values["recompute_layers"] = layers
    else:
        values["recompute"] = p.get("recompute") or "none"
    if (p.get("vpp") or 1) > 1:
        values.update(vpp=p["vpp"], schedule="interleaved")
    elif p.get("schedule") in ("gpipe", "1f1b"):
        values["schedule"] = p["schedule"]
    for key in ("offload_optimizer", "offload_params"):
        if p.get(key) not in (None, "none"):
            values[key] = p[key]
    values.update(run_recipe(row))
    global_batch = values["mbs"] * values["ga"] * values["dp_shard"] * values["dp_replicate"]
    return build_plan(values, world=world, blocks=blocks, global_batch=global_batch, source=row["id"])


def run_recipe(row: dict[str, Any]) -> dict[str, Any]:
    """The recipe a run used, as the plan keys a user types (``--plan compile=true,...``):
    torch.compile, fused kernels (loss and MLP), async TP, and the fp8 recipe (torchao's
    rowwise or tensorwise under FSDP2, as its options say; Transformer Engine's delayed scaling
    elsewhere)."""
    options = row.get("options") or {}
    out: dict[str, Any] = {"compile": bool(options.get("compile")), "fused_loss": bool(options.get("fused_kernels")),
                           "tp_overlap": "async" if options.get("async_tp") else "none"}
    if row["precision"] == "fp8":
        torchao = _declared(row["framework"], "bf16_recipe", "bf16") == "bf16-fsdp2"
        rowwise = "rowwise" in str(options.get("ac_detail"))
        out["fp8"] = "rowwise" if rowwise else ("tensorwise" if torchao else "delayed")
    return out


def load_runs(path: str | Path, skipped: list[tuple[str, str]] | None = None) -> list[PublishedRun]:
    """Every run of the file that names a complete model, plan and throughput; the others are
    appended to ``skipped`` as (id, why)."""
    runs = []
    for row in yaml.safe_load(Path(path).read_text()):
        try:
            runs.append(_run(row))
        except (SpecError, KeyError, TypeError) as exc:
            if skipped is not None:
                skipped.append((row.get("id", "?"), str(exc)))
    return runs


def _run(row: dict[str, Any]) -> PublishedRun:
    model_doc = {**row["model"], "training": {"global_batch": 1, "precision": _precision(row)}}
    if isinstance(model_doc["training"]["precision"], Precision):
        model_doc["training"]["precision"] = model_doc["training"]["precision"].model_dump()
    model = model_from_dict(model_doc, source=row["id"])
    cluster = _cluster(row)
    plan = _plan(row, model.layers, cluster.gpus)  # type: ignore[union-attr]
    model = model.model_copy(update={"training": model.training.model_copy(update={"global_batch": plan.global_batch})})
    assume = DEFAULT.replace(**_declared(row["framework"], "behaviour", {}))
    config = (row.get("options") or {}).get("framework_config")
    if config:  # what the run's own configuration states (bucket sizes, the framework's version)
        stated = _declared(row["framework"], "run_assumptions", None)
        if stated is None:
            raise SpecError(f"options.framework_config is read for deepspeed runs, not {row['framework']}", source=row["id"])
        assume = assume.replace(**stated(config))
    kernel = (row.get("options") or {}).get("attention_kernel")
    if kernel is not None:  # the fused attention kernel its source states (FlashAttention before FA-2's release)
        if kernel not in ATTENTION_KERNELS:
            raise SpecError(f"options.attention_kernel {kernel!r} is not one of {', '.join(ATTENTION_KERNELS)}",
                            source=row["id"])
        assume = assume.replace(attention_kernel=kernel)
    # a configuration its source reports out of memory is scored for whether it fits, not for time
    metric, measured = ("oom", float("nan")) if (row.get("measured") or {}).get("oom") else _metric(row)
    return PublishedRun(id=row["id"], source=row["source"], framework=row["framework"], model=model,
                        cluster=cluster, plan=plan, assumptions=assume, metric=metric, measured=measured,
                        family=gpu_family(row["cluster"]["gpu_profile"]), raw=row)


def predict(run: PublishedRun, assume: Assumptions | None = None) -> tuple[float, Evaluation]:
    """The prediction of ``run``'s metric, and the full evaluation."""
    ev = evaluate(run.model, run.cluster, run.plan, assume or run.assumptions, allow_tp_across_nodes=True)
    value = {"tokens_per_s_per_gpu": ev.tokens_per_s / run.cluster.gpus, "mfu": ev.mfu,
             "tflops_per_gpu": ev.tflops_per_gpu, "hw_tflops_per_gpu": ev.hw_tflops_per_gpu}.get(run.metric, float("nan"))
    return value, ev


def megatron_runs(path: str | Path) -> list[PublishedRun]:
    """Megatron-LM 2021 Table 1 (Narayanan et al., arXiv 2104.04473) as runs: GPT models (4h GeLU
    MLP, layernorm, biases, learned positions, tied embeddings, dropout, no flash attention) on
    DGX A100 80GB with HDR InfiniBand, the table's degrees, micro-batch 1, full recompute (its Eq. 3),
    interleaved where the paper says so; TFLOP/s as Megatron counts them (recompute included)."""
    runs = []
    for case in read_document(path)["cases"]:
        m, par = case["model"], case["parallel"]
        batch = case["training"]["global_batch_sequences"]
        model = model_from_dict({
            "name": f"gpt-{m['layers']}x{m['hidden']}", "layers": m["layers"], "hidden": m["hidden"],
            "ffn_hidden": 4 * m["hidden"], "heads": m["heads"], "vocab": m["vocab"], "seq_len": m["seq_len"],
            "ffn": "gelu", "norm": "layernorm", "bias": True, "tied_embeddings": True, "position": "learned",
            "dropout": True, "flash_attention": False,
            "training": {"global_batch": batch, "precision": "fp16", "optimizer": "adam"}}, source=case["id"])
        gpus = case["cluster"]["gpus_total"]
        cluster = cluster_from_dict({"name": f"dgx-a100x{gpus}", "nodes": max(1, gpus // 8), "gpus_per_node": min(gpus, 8),
                                     "gpu": "a100-sxm4-80gb", "intra_node": "nvlink3", "inter_node": "ib-hdr"})
        per_stage = m["layers"] // par["pp"]
        vpp = next((v for v in (2, 3) if per_stage % v == 0 and per_stage > 1), 1) if par["interleaved_schedule"] else 1
        values = {"tp": par["tp"], "pp": par["pp"], "dp": par["dp"], "mbs": 1, "recompute": "full", "sp": False,
                  "vpp": vpp, "zero": 0}
        plan = build_plan(values, world=gpus, blocks=m["layers"], global_batch=batch, source=case["id"])
        runs.append(PublishedRun(id=case["id"], source=case["source"], framework="megatron", model=model,
                                 cluster=cluster, plan=plan, assumptions=DEFAULT.replace(**_declared(
                                     "megatron", "behaviour", {})),
                                 metric="hw_tflops_per_gpu", measured=float(case["measured"]["tflops_per_gpu"]),
                                 family="a100", raw=case))
    return runs
