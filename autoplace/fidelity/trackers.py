"""Measure a training step with PyTorch's own trackers and set autoplace's prediction beside it.

Ground truth nobody here wrote (issue 6, item 1): a Llama-style model built from a
:class:`~autoplace.specs.model.TransformerSpec` on fake tensors (``FakeTensorMode``: shapes
and dtypes, no storage), sharded with FSDP2 ``fully_shard`` over a fake process group
(``torch.testing._internal.distributed.fake_pg``; collectives are no-ops), one AdamW step
under ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, which files every live
tensor storage under a category (sharded/unsharded params and grads, optimizer state,
activations, temporaries, all-gather/reduce-scatter buffers).  A dispatch mode counts the
bytes of every c10d collective (``CommDebugMode`` counts calls, not bytes).

What is measured is what the runtime trains: the :class:`Setup` becomes a
:class:`~autoplace.plan.Plan`, the ranks are laid out by the runtime's
:func:`~autoplace.runtime.parallel.build_layout`, the model is the runtime's
(:func:`~autoplace.runtime.model.build_model`) and it is parallelized by the runtime's
:func:`~autoplace.runtime.parallel.parallelize`; the byte counter is the runtime's
(:mod:`autoplace.runtime.comms`), filing by finer groups.  One difference, forced by fake
tensors: MoE tokens are routed by the balanced rule (:mod:`autoplace.runtime.moe`), since a
router's top-k has no values to decide shapes with.  The prediction set beside the
measurement: :mod:`autoplace.fidelity.compare`.  torch is imported only inside the fidelity
and runtime packages (``pip install torch`` if it is missing).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from autoplace.errors import BenchmarkError

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise BenchmarkError("autoplace.fidelity needs PyTorch: pip install torch (CPU wheel is enough)") from exc

from autoplace.cost.layers import layer_table
from autoplace.dryrun.steps import fake_world
from autoplace.plan import Plan, build_plan
from autoplace.runtime import parallel as par
from autoplace.runtime.comms import CollectiveCount, CommLog, CountingMode
from autoplace.runtime.model import build_model
from autoplace.specs.model import TransformerSpec

log = logging.getLogger("autoplace")
PRECISIONS = ("fp32", *par.MIXED)


@dataclass(frozen=True)
class Setup:
    """How the torch side is parallelized; the autoplace plan is derived from it.

    Attributes:
        world: ranks of the fake process group.
        reshard: FSDP2 ``reshard_after_forward`` of the blocks (True: ZeRO-3, False: ZeRO-2,
            the mapping autoplace's FSDP2 emitter uses).
        root_reshard: the root module's (embedding, final norm, head) ``reshard_after_forward``;
            autoplace's emitter and torchtitan leave it False (gathered once per step).
        dp_replicate: HSDP replica groups (a ``(dp_replicate, dp_shard)`` mesh when > 1).
        tp: DTensor tensor parallelism (Megatron column/row pairs, vocab-parallel embedding,
            column-parallel head with ``loss_parallel``, one shared matrix when tied; no sequence
            parallelism; dense blocks only).
        ep: expert parallelism carved from the ``dp_shard`` ranks (MoE only, no HSDP or TP), laid
            out as the runtime does (``build_expert_mesh``: EP ranks innermost): dense weights
            sharded over all of ``dp_shard``, experts over the expert-data-parallel ``edp``.
        precision: "fp32" (no mixed precision) or "bf16-fsdp2" (``MixedPrecisionPolicy`` with
            bf16 parameters and fp32 reduction: autoplace's recipe of that name).
        mbs: micro-batch in sequences.
    """

    world: int = 8
    reshard: bool = True
    root_reshard: bool = False
    dp_replicate: int = 1
    tp: int = 1
    precision: str = "fp32"
    mbs: int = 1
    ep: int = 1

    @property
    def dp_shard(self) -> int:
        return self.world // (self.dp_replicate * self.tp)

    def plan(self, spec: TransformerSpec) -> Plan:
        """The autoplace plan this setup runs (reshard True: ZeRO-3; False: ZeRO-2, the mapping
        autoplace's FSDP2 emitter and the runtime use), one micro-batch per rank, no SP."""
        values = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "ep": self.ep,
                  "sp": False, "zero": 3 if self.reshard else 2, "mbs": self.mbs, "ga": 1}
        return build_plan(values, world=self.world, blocks=layer_table(spec).blocks,
                          global_batch=self.mbs * self.world // self.tp)

    def label(self) -> str:
        parts = [f"rep{self.dp_replicate}" if self.dp_replicate > 1 else "", f"fsdp{self.dp_shard}",
                 f"ep{self.ep}" if self.ep > 1 else "", f"tp{self.tp}" if self.tp > 1 else ""]
        root = "" if self.root_reshard == self.reshard or not self.reshard else " root-kept"
        return f"{'x'.join(p for p in parts if p)} reshard={str(self.reshard)[0]}{root} {self.precision} mbs{self.mbs}"


@dataclass(frozen=True)
class Measurement:
    """What the trackers saw on one rank in the second (steady-state) training step.

    Attributes:
        peak: bytes per tracker category at the moment of the total peak ("Total" included).
        category_peak: the highest value each category reached on its own.
        after_forward: bytes per category once the loss exists (activations kept for backward).
        collectives: per (mesh dimension, collective kind), calls and bytes.
        params: parameters of the torch model.
    """

    peak: dict[str, float]
    category_peak: dict[str, float]
    after_forward: dict[str, float]
    collectives: dict[tuple[str, str], CollectiveCount]  # (dim, kind)
    params: int


def _tracker_class() -> type:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class PeakPerCategory(FSDPMemTracker):  # type: ignore[misc, valid-type]
        """FSDPMemTracker that also keeps every category's own maximum."""

        category_peak: dict[str, float] = {}

        def _update_peak_stats(self, peak_state: Any) -> None:
            super()._update_peak_stats(peak_state)
            for snap in self._curr_mem_snap.values():
                for key, value in snap.items():
                    key = getattr(key, "value", key)
                    self.category_peak[key] = max(self.category_peak.get(key, 0), value)

        def reset_peaks(self) -> None:
            self.reset_mod_stats()  # FSDPMemTracker refuses a second iteration without it
            self.category_peak = {}
            self._peak_mem = {}
            self._peak_mem_snap = {}

    return PeakPerCategory


def _flat(snapshot: dict[Any, dict[Any, int]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for snap in snapshot.values():
        for key, value in snap.items():
            key = getattr(key, "value", key)
            out[key] = out.get(key, 0.0) + float(value)
    return out


def measure(spec: TransformerSpec, setup: Setup) -> Measurement:
    """Run two training steps on fake tensors; return what the second one used and sent.

    Raises:
        BenchmarkError: degrees that do not divide the world, the model's heads or its experts,
            or a layout that is not built (MoE with TP, EP with HSDP or TP).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if setup.world % (setup.dp_replicate * setup.tp):
        raise BenchmarkError(f"dp_replicate({setup.dp_replicate}) * tp({setup.tp}) must divide world({setup.world})")
    if spec.n_kv_heads % setup.tp:
        raise BenchmarkError(f"tp({setup.tp}) must divide kv_heads({spec.n_kv_heads})")
    if setup.tp > 1 and spec.moe is not None:
        raise BenchmarkError("tp > 1 with routed experts is not built (the TP plan covers dense MLPs only)")
    _check_ep(spec, setup)
    if setup.precision not in PRECISIONS:
        raise BenchmarkError(f"precision {setup.precision!r} is not measured; valid: {', '.join(PRECISIONS)}")
    plan = setup.plan(spec)
    with fake_world(setup.world):
        # the meshes hold real rank tensors: lay the ranks out before entering fake mode
        layout = par.build_layout(plan, setup.world, "cpu")
        fake = FakeTensorMode()
        with fake:
            model = build_model(spec, routing="balanced")
            params = sum(p.numel() for p in model.parameters())
            if spec.training.frozen_base:
                add_lora(model, spec)
        # parallelize outside the mode: the fake parameters carry it with them, while the
        # mesh arithmetic FSDP2 does for a 2-D (dp, tp) mesh needs real rank tensors
        par.parallelize(model, plan, layout, precision=setup.precision, root_reshard=setup.root_reshard,
                        loss_parallel=setup.tp > 1)
        with fake, _separate_propagation_mode():
            return _step(model, params, spec, setup, group_roles(layout))


# LoRA roles -> the runtime model's (torchtitan's) module names: w1 is SwiGLU's gate (GeLU's up),
# w3 its up, w2 the down projection
_RUNTIME_MODULES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w1", "up": "w3", "down": "w2"}


class LoRALinear(nn.Module):
    """PEFT's LoRA ``Linear`` as it computes without dropout: ``base(x) + scale * B(A(x))``
    with ``A`` (``r x in``) and ``B`` (``out x r``); the base stays frozen.  (PEFT itself
    cannot wrap fake-tensor modules: its ``.to()`` swaps parameters that fake mode references.)"""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scale


def add_lora(model: nn.Module, spec: TransformerSpec) -> None:
    """LoRA on the spec's targets (:class:`LoRALinear` in place of each targeted ``nn.Linear``,
    so the model keeps its class and is parallelized as before); every other parameter is frozen."""
    lora = spec.training.lora
    names = dict(_RUNTIME_MODULES, up="w1" if spec.ffn != "swiglu" else "w3")
    targets = {names[r] for r in lora.targets if spec.ffn == "swiglu" or r != "gate"}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, lora.rank, lora.alpha))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def group_roles(layout: par.Layout) -> dict[str, str]:
    """Process-group name -> mesh dimension, finer than the runtime's (which files all of these as
    "dp"): ``dp_shard``, ``dp_replicate``, ``tp``, and with ep > 1 ``edp`` and ``ep``."""
    out = {str(layout.mesh[d].get_group().group_name): d for d in layout.dims}
    if layout.ep_group is not None:
        out[str(layout.edp_group.group_name)] = "edp"
        out[str(layout.ep_group.group_name)] = "ep"
    return out


def _check_ep(spec: TransformerSpec, setup: Setup) -> None:
    """Expert parallelism is built for MoE models on a plain FSDP mesh (no HSDP, no TP).

    Raises:
        BenchmarkError: a layout the harness does not build.
    """
    if setup.ep == 1:
        return
    if spec.moe is None:
        raise BenchmarkError(f"ep={setup.ep} but {spec.name} has no experts")
    if setup.dp_replicate > 1 or setup.tp > 1:
        raise BenchmarkError("ep > 1 is built on a plain FSDP mesh only (dp_replicate = tp = 1)")
    if setup.dp_shard % setup.ep or spec.moe.experts % setup.ep:
        raise BenchmarkError(f"ep({setup.ep}) must divide dp_shard({setup.dp_shard}) and experts({spec.moe.experts})")


@contextmanager
def _separate_propagation_mode() -> Iterator[None]:
    """Give DTensor's sharding propagation a fake mode of its own.

    DTensor derives global output shapes by running the op on global-shape fake tensors in
    ``detect_fake_mode() or FakeTensorMode()``; inside our FakeTensorMode it would reuse ours,
    and FSDPMemTracker (which skips only ops under a *different* fake mode) would count those
    phantom global tensors -- e.g. full-vocabulary fp32 logits under ``loss_parallel``.  On a
    real run they live on the meta device and use no memory.
    """
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    own = FakeTensorMode()
    with mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args: own):
        yield


def _step(model: nn.Module, params: int, spec: TransformerSpec, setup: Setup, dims: dict[str, str]) -> Measurement:
    from contextlib import nullcontext

    from torch.distributed.tensor.parallel import loss_parallel

    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(0, spec.vocab, (setup.mbs, spec.seq_len))
    labels = torch.randint(0, spec.vocab, (setup.mbs, spec.seq_len))
    tracker = _tracker_class()(model, optim)
    tracker.track_inputs((tokens, labels))
    comm = CommLog(dims)
    comm.enabled = True
    loss_ctx = loss_parallel if setup.tp > 1 else nullcontext
    with tracker:
        for step in range(2):
            if step == 1:  # steady state: optimizer state exists from the start of the step
                tracker.reset_peaks()
                comm.reset()
            with CountingMode(comm), loss_ctx():
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                del logits  # torchtitan's train step drops the logits before backward
                after_forward = _flat(tracker.get_tracker_snapshot("current"))
                loss.backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
                del loss
    return Measurement(peak=_flat(tracker.get_tracker_snapshot("peak")), category_peak=dict(tracker.category_peak),
                       after_forward=after_forward, collectives=dict(comm.counts), params=params)


