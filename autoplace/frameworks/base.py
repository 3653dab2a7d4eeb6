"""The one small base class every supported training framework implements.

A framework module (``autoplace/frameworks/<name>.py``) declares, in one place, everything
autoplace knows about the framework: how it stores and moves the training states (its precision
recipe and its costing overrides), what it can express (search features, pinned degrees,
recompute rules, compression options), what it refuses and why, how a plan becomes its files
and how its files become a plan again, and how its job starts.  The registry
(:mod:`autoplace.frameworks`) finds it by name.

The call sequence, as ``autoplace solve`` makes it:

1. :meth:`Framework.model_refusal` once per model: ``None``, or one line naming the model
   feature the framework cannot train (the framework is then inadmissible for the model);
2. :meth:`Framework.costing` and :meth:`Framework.search_limits` to build its search problem;
3. :meth:`Framework.config_check` once per model, then the returned check once per configuration
   shape the search enumerates (whatever its micro-batching), :meth:`Framework.batching_refusal`
   once per micro-batching of a shape it admits, and :meth:`Framework.plan_check` once per plan the
   search returns: ``None``, or why the framework cannot run the plan -- decided from these
   declarations, never by rendering;
4. :meth:`Framework.render` for the plans written to a bundle (which raises
   :class:`~autoplace.errors.EmitError` exactly when the check refuses: a contract test holds
   every framework to it), :meth:`Framework.program` for its launch line and environment;
5. :meth:`Framework.read` when ``autoplace check`` reads one of its files back into a plan;
6. :meth:`Framework.dry_run` when ``autoplace dryrun`` builds, with the framework's own code, what one
   rank of a bundle's launch builds before its first step (:mod:`autoplace.dryrun`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from autoplace.emit.launch import Launch, Program, user_program
from autoplace.errors import EmitError
from autoplace.plan import RECIPE_DEFAULTS, RECIPE_KEYS, SLOT_KEYS

if TYPE_CHECKING:
    from autoplace.cost.assumptions import Assumptions
    from autoplace.dryrun.steps import DryContext, Steps
    from autoplace.plan import Config, Plan
    from autoplace.specs.cluster import ClusterSpec
    from autoplace.specs.model import ModelSpec

BF16_RECIPES = ("bf16", "bf16-fsdp2", "bf16-fp32-grads")  # specs.model recipe names a framework may swap in

PlanCheck = Callable[["Plan"], "str | None"]


@dataclass(frozen=True)
class ReadConfig:
    """What a framework config says, as a Plan.

    Attributes:
        plan: the placement the config runs.
        framework: the registered name of the framework whose file it is (or ``plan.json``).
        batch_stated: whether the config itself fixes the global batch (accelerate's does not).
        notes: what was filled in from the model or cluster, or left unresolved ("auto" values).
        runner: for a plan.json, the registered framework whose own bundle it is (its plan is
            costed as that framework runs it); a framework's config is run by ``framework``.
    """

    plan: Plan
    framework: str
    batch_stated: bool
    notes: tuple[str, ...] = ()
    runner: str | None = None


@dataclass(frozen=True)
class BundleFile:
    """One file a framework writes: its name in the bundle, the README line, the text."""

    name: str
    what: str
    text: str
    executable: bool = False


class Framework:
    """A training framework autoplace plans for, configures and reads back.

    ``peft_runners`` names the frameworks whose bundles fine-tune with PEFT (for refusals' advice).

    Subclasses set the class attributes and implement :meth:`plan_check` and :meth:`render`;
    the rest has defaults that say "nothing special".
    """

    name: ClassVar[str]
    title: ClassVar[str]  # as people write it: "DeepSpeed"
    # the specs.model recipe this framework implements under bf16 mixed precision
    bf16_recipe: ClassVar[str] = "bf16"
    # Assumptions fields that differ in how this framework runs what the plan names
    behaviour: ClassVar[Mapping[str, Any]] = {}
    # and those that differ again for a training method (lora, qlora: the bundle's PEFT script)
    method_behaviour: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    denied_features: ClassVar[frozenset[str]] = frozenset()  # solvers.problem.FEATURES it never has
    # the pipeline schedules (autoplace.plan.SCHEDULES) its config can run; one that runs none of the
    # zero-bubble ones has no zero-bubble feature (frameworks.search.pinned), so its searches never build them
    schedules: ClassVar[frozenset[str]] = frozenset({"gpipe", "1f1b", "interleaved"})
    pinned_degrees: ClassVar[Mapping[str, int]] = {}  # degrees it runs only at this value
    # recompute modes it can apply to all blocks alike
    uniform_recompute: ClassVar[tuple[str, ...]] = ("none", "selective", "full")
    # what else it states per layer: "any" mix (it chooses per block), "first" (full on the first k
    # blocks of every pipeline chunk: Megatron-LM's block method), "every" (full on every N-th block:
    # torchtitan's layer SAC), or None; the search tries "any" and, without a pipeline, "first"
    layer_recompute: ClassVar[str | None] = "any"
    compressions: ClassVar[frozenset[str]] = frozenset()  # compress options it configures (besides none)
    config_suffixes: ClassVar[tuple[str, ...]] = ()  # file suffixes :meth:`read` takes
    config_file: ClassVar[str | None] = None  # the bundle file :meth:`read` reads back (its plan)
    # whether the TFLOP/s it logs count the recompute forward (hardware FLOPs, not model FLOPs)
    reports_hardware_flops: ClassVar[bool] = False
    # training methods (specs.model Training.method) its files can run: full, lora, qlora
    methods: ClassVar[frozenset[str]] = frozenset({"full"})
    peft_runners: ClassVar[tuple[str, ...]] = ("accelerate", "deepspeed")
    # recipe keys (plan.RECIPE_KEYS) it configures: the values its config can state, the one the
    # search takes first (fp8: the recipes it implements, searched only with --allow fp8).  A key
    # not listed takes only its default (plan.RECIPE_DEFAULTS).
    recipes: ClassVar[Mapping[str, tuple[Any, ...]]] = {"overlap": (True,)}
    # the plan fields :meth:`config_check` reads when it reads neither the layer split nor the
    # recompute modes (the model's are judged once): the search judges a configuration once per
    # distinct value of them.  None: undeclared (it is asked of every configuration)
    config_fields: ClassVar[tuple[str, ...] | None] = None
    # whether :meth:`batching_refusal` refuses a micro-batching the search enumerates (it then asks it of
    # each); the search builds interleaved schedules only at a multiple of pp micro-batches
    batching_rules: ClassVar[bool] = False
    # whether its config can count the embedding and the loss as pipeline layers (plan keys
    # pp_embedding / pp_loss, autoplace.plan.stage_slots); the search tries them only for such a one
    pipeline_slots: ClassVar[bool] = False
    # whether the model it builds has the multi-token-prediction modules a config names (DeepSeek-V3's
    # num_nextn_predict_layers): Megatron-LM's --mtp-num-layers does; transformers' DeepseekV3ForCausalLM
    # drops them (its _keys_to_ignore_on_load_unexpected: model.layers.61), so the Hugging Face runners
    # train and are costed without (:meth:`costing`)
    builds_mtp: ClassVar[bool] = False

    # --- what it can train -------------------------------------------------------------------

    def model_refusal(self, model: ModelSpec) -> str | None:
        """Why this framework cannot train ``model`` whatever the plan (one line naming the
        feature: its training method or its architecture), or None."""
        method = model.training.method
        if method not in self.methods:
            label = {"lora": "LoRA", "qlora": "QLoRA"}.get(method, method)
            return (f"{self.name}: training.method {method}: {self.title} has no {label} path here "
                    f"(fine-tune with {' or '.join(sorted(self.peft_runners))} and PEFT)")
        return self.architecture_refusal(model)

    def architecture_refusal(self, model: ModelSpec) -> str | None:
        """Why this framework cannot build ``model``'s architecture (one line naming the feature), or
        None: by default its bundle trains the user's own model code (a Hugging Face model or any
        nn.Module), so every feature is that code's and the files state parallelism and precision only."""
        del model
        return None

    def degree_refusals(self, model: ModelSpec) -> Mapping[str, str]:
        """Degrees this framework cannot raise above 1 for ``model`` (its architecture, not the plan):
        degree -> why, one line naming the feature.  A ``--fix`` of one is refused before any search;
        :meth:`plan_check` refuses the plans.  By default none."""
        del model
        return {}

    def plan_check(self, model: ModelSpec) -> PlanCheck:
        """A check for plans of ``model``: ``check(plan)`` is None when this framework's config
        expresses ``plan``, else one line naming what it cannot.  The model's own rules are
        judged once here, the plan's per call (the search judges thousands)."""
        raise NotImplementedError

    def config_check(self, model: ModelSpec) -> PlanCheck:
        """:meth:`plan_check` without the rules that read the layer split, per-layer recompute or the
        micro-batching (:meth:`batching_refusal`): the search judges a configuration before it has
        chosen those (on an even split with no recompute), and judges the final plans with
        :meth:`plan_check`.  It must admit every plan :meth:`plan_check` admits (a contract test checks it)."""
        return self.plan_check(model)

    def batching_refusal(self, config: Config) -> str | None:
        """Why this framework cannot run ``config``'s micro-batching (``mbs``-sequence micro-batches,
        ``grad_accum`` of them per step) on its pipeline, or None: by default it runs every one.

        It reads only ``pp``, ``vpp``, ``schedule``, ``mbs`` and ``grad_accum``.  :meth:`config_check`
        never reads the micro-batching (the search judges a shape once, then each micro-batching of
        it here, when :attr:`batching_rules` says there is a rule); :meth:`plan_check` includes it.
        """
        del config
        return None

    def recompute_modes(self, config: Config) -> tuple[str, ...]:
        """The recompute modes it applies to every block alike in ``config``'s plans: its
        :attr:`uniform_recompute`, unless what ``config`` runs leaves some out."""
        del config
        return self.uniform_recompute

    def forced_split(self, blocks: int, pp: int) -> tuple[int, ...] | None:
        """The layer split this framework always makes for ``pp`` stages (it takes no explicit one),
        or None when the plan's split is written into its files."""
        del blocks, pp
        return None

    def refusal(self, plan: Plan, model: ModelSpec) -> str | None:
        """Why this framework cannot run ``plan`` of ``model`` (model or plan), or None."""
        return self.model_refusal(model) or self.plan_check(model)(plan)

    # --- how it is costed ---------------------------------------------------------------------

    def costing(self, model: ModelSpec, assumptions: Assumptions) -> tuple[ModelSpec, Assumptions]:
        """``model`` as this framework builds it -- with the bf16 recipe it implements (other recipes
        are left as they are), without multi-token-prediction modules unless it builds them -- and
        ``assumptions`` with its behaviour (and its training method's)."""
        precision = model.training.precision
        if precision in BF16_RECIPES and precision != self.bf16_recipe:
            training = model.training.model_copy(update={"precision": self.bf16_recipe})
            model = model.model_copy(update={"training": training})
        if getattr(model, "mtp_layers", 0) and not self.builds_mtp:
            model = model.model_copy(update={"mtp_layers": 0})
        behaviour = {**self.behaviour, **self.method_behaviour.get(model.training.method, {})}
        return model, assumptions.replace(**behaviour) if behaviour else assumptions

    # --- its files ----------------------------------------------------------------------------

    def render(self, plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch) -> list[BundleFile]:
        """The framework's own files for ``plan`` (configs, argument files, modules; not the
        generic launch scripts, which take :meth:`program`).

        Raises:
            EmitError: the framework cannot express the plan -- exactly :meth:`refusal`'s line, so
                the files and the search never disagree on a plan or on why.
        """
        self.refuse(self.refusal(plan, model))
        return self.files(plan, model, cluster, launch)

    def files(self, plan: Plan, model: ModelSpec, cluster: ClusterSpec, launch: Launch) -> list[BundleFile]:
        """The files of a plan :meth:`refusal` admits (:meth:`render` checks first)."""
        raise NotImplementedError

    def program(self, plan: Plan, model: ModelSpec, launch: Launch) -> Program:
        """The launch line every node runs: by default the user's script under torchrun."""
        del plan, model
        return Program(user_program(launch))

    def read(self, path: Path, model: ModelSpec, cluster: ClusterSpec) -> ReadConfig:
        """One of this framework's config files as the plan it runs.

        Raises:
            SpecError: unknown or contradictory keys, naming the file and the key.
        """
        raise EmitError(f"{self.name}: autoplace reads no {self.title} config back")

    def dry_run(self, ctx: DryContext, steps: Steps) -> None:
        """Build, with this framework's own code, what rank ``ctx.rank`` of the bundle's launch builds
        before its first step: on a fake process group of ``ctx.world`` ranks and the meta device, from
        the words ``ctx.launched`` passes its program (never from plan.json: the files are what runs).

        Each step runs inside ``steps.step(name)`` (the framework's first error ends the run, with the
        fix autoplace suggests); a step that needs a GPU is ``steps.skip``-ped, saying why; the rank's
        pipeline stage goes to ``steps.stage`` and the bytes it allocated per training state to
        ``steps.measured``.  Heavy imports (torch, the framework) happen inside.
        """
        del ctx
        steps.skip(f"{self.title}'s setup", f"autoplace has no dry run of {self.title} bundles")

    def refuse(self, reason: str | None) -> None:
        """Raise the EmitError of ``reason`` (its render's guard), or nothing for None."""
        if reason is not None:
            raise EmitError(reason)


def unstated_recipe(config: Config, framework: type[Framework] | Framework) -> str | None:
    """The first recipe key ``config`` sets to a value ``framework`` cannot state
    (:attr:`Framework.recipes`; a key it does not declare has only its default), or the first
    pipeline-split key it sets that the framework cannot (:attr:`Framework.pipeline_slots`), or None."""
    key = (framework.name, _RECIPE_VALUES(config))  # judged once per framework and recipe (the search asks often)
    if key not in _UNSTATED:
        _UNSTATED[key] = next((k for k, value in zip(_STATED, key[1], strict=True)
                               if recipe_refusal(framework, k, value)), None)
    return _UNSTATED[key]


_UNSTATED: dict[tuple[str, tuple[Any, ...]], str | None] = {}
_STATED = (*RECIPE_KEYS, *SLOT_KEYS)  # the keys unstated_recipe judges, in that order
_RECIPE_VALUES = operator.attrgetter(*_STATED)  # a configuration's values of them


def check_recipe(plan: Plan, framework: type[Framework]) -> None:
    """Raise EmitError when ``plan`` sets a recipe key to a value ``framework`` cannot state
    (:attr:`Framework.recipes`) or a pipeline-split key it cannot (:attr:`Framework.pipeline_slots`),
    TP-comm overlap without tensor parallelism, or a schedule it does not run (:attr:`Framework.schedules`)."""
    key = unstated_recipe(plan, framework)
    if key is not None:
        raise EmitError(recipe_refusal(framework, key, getattr(plan, key)) or key)
    if plan.tp_overlap != "none" and plan.tp == 1:
        raise EmitError(f"{framework.name}: tp_overlap={plan.tp_overlap} needs tensor parallelism (tp > 1)")
    if plan.schedule not in framework.schedules:
        raise EmitError(schedule_refusal(framework, plan.schedule))


def schedule_refusal(framework: type[Framework] | Framework, schedule: str) -> str:
    """The line refusing pipeline schedule ``schedule``, which ``framework`` does not run."""
    return (f"{framework.name}: schedule={schedule}: {framework.title} does not run it "
            f"(its schedules: {', '.join(sorted(framework.schedules))})")


def recipe_refusal(framework: type[Framework] | Framework, key: str, value: Any) -> str | None:
    """Why ``framework``'s config cannot state recipe key ``key`` at ``value`` (one line), or None;
    the same of the pipeline-split keys (``pp_embedding``, ``pp_loss``)."""
    if key in SLOT_KEYS:
        return None if not value or framework.pipeline_slots else (
            f"{framework.name}: {key}=true: {framework.title}'s config cannot count the "
            f"{'embedding' if key == 'pp_embedding' else 'loss'} as a pipeline layer")
    valid = framework.recipes.get(key, (RECIPE_DEFAULTS[key],))
    if value in valid:
        return None
    shown = ", ".join(str(v).lower() for v in valid)
    return f"{framework.name}: {key}={str(value).lower()} is not configurable (it states {key}={shown})"


def checked(check: Callable[[Plan], None]) -> PlanCheck:
    """A check that raises EmitError (an emitter's guard) as a :data:`PlanCheck`: None, or the line."""

    def plan_check(plan: Plan) -> str | None:
        try:
            check(plan)
        except EmitError as exc:
            return str(exc)
        return None

    return plan_check
