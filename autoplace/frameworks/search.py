"""Searching for frameworks: their costing, their admissible configurations, their best plans.

``autoplace solve --framework F`` answers "the best plan I can run with F": the model is costed
with the recipe F really uses (FSDP2 keeps fp32 shards and reduces in fp32; DeepSpeed and
Megatron keep 16-bit weights and an fp32 master copy), the search leaves out what F can never
express, and every returned plan is one F's config expresses.  ``--framework any`` (the default)
searches the configurations at least one framework can express and keeps the plans one can run;
``none`` is the theoretical optimum, unfiltered.  Every verdict comes from the frameworks'
declarations (:meth:`~autoplace.frameworks.base.Framework.plan_check`), never from rendering.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

from autoplace.cost.assumptions import DEFAULT
from autoplace.errors import AutoplaceError, Infeasible, SpecError
from autoplace.frameworks import ANY, FRAMEWORKS, NONE, check_name, get
from autoplace.frameworks.base import Framework, PlanCheck, recipe_refusal, schedule_refusal, unstated_recipe
from autoplace.plan import (
    FIRST_FULL,
    PER_LAYER,
    RECIPE_KEYS,
    RECOMPUTE,
    SLOT_KEYS,
    ZERO_BUBBLE,
    Config,
    Plan,
    split_units,
    with_pins,
)
from autoplace.specs.cluster import ClusterSpec, fp8_refusal
from autoplace.specs.model import ModelSpec


def members(framework: str) -> list[Framework]:
    """The frameworks ``framework`` stands for: one, or every registered one for ``any``."""
    return [get(f) for f in FRAMEWORKS] if framework == ANY else [get(framework)]


def search_limits(framework: Framework, model: ModelSpec, fixed: dict[str, Any], features: set[str]
                  ) -> tuple[dict[str, Any], set[str]]:
    """The user's ``--fix`` values with the framework's pinned degrees added, and the features left.

    Raises:
        SpecError: the user pinned a degree the framework cannot run, or cannot run for this model, or a
            pipeline schedule it does not run (:attr:`Framework.schedules`).
    """
    for key, value in framework.pinned_degrees.items():
        if key in fixed and int(fixed[key]) != value:
            raise SpecError(f"{framework.name} cannot run {key}={fixed[key]} (it supports only {key}={value})",
                            field="--fix")
    for key, why in framework.degree_refusals(model).items():
        if int(fixed.get(key, 1)) > 1:
            raise SpecError(f"{framework.name} cannot run {key}={fixed[key]} for {model.name}: {why}", field="--fix")
    if fixed.get("schedule", "1f1b") not in framework.schedules:  # one it does not run: named, not "no configuration"
        raise SpecError(schedule_refusal(framework, fixed["schedule"]), field="--fix")
    unrun = set() if framework.schedules & ZERO_BUBBLE else {"zero-bubble"}  # it runs none of them
    return {**framework.pinned_degrees, **fixed}, features - framework.denied_features - unrun


def problem_for(framework: str, model: ModelSpec, cluster: ClusterSpec, *, fixed: dict[str, Any],
                features: set[str], **options: Any) -> Any:
    """The solver Problem for ``framework`` (``any``, ``none`` or a registered name): the model
    costed as the framework runs it, its pinned degrees and features, its admissible configurations.

    Args:
        options: the other Problem fields (objective, top_k, assumptions, ...).

    The recipe keys the model file pins (``training.recipe``) are fixed as ``--fix`` fixes them.

    Raises:
        SpecError: an unknown framework, a ``--fix`` the framework cannot run, one that contradicts
            the model file's pins, or fp8 on GPUs without fp8 units.
        Infeasible: a model the framework cannot train (the line names the feature).
    """
    check_name(framework)
    fixed = with_pins(fixed, model.training.recipe_pins.values(), source="--fix")
    why = fp8_refusal(cluster, fixed.get("fp8", "none"))
    if why:
        raise SpecError(why, source="model file training.recipe" if "fp8" in model.training.recipe_pins.values()
                        else "--fix", field="fp8")
    if framework not in (ANY, NONE):
        return framework_problem(get(framework), model, cluster, fixed=fixed, features=features, **options)
    from solvers.problem import Problem

    able = [f for f in members(ANY) if f.model_refusal(model) is None]  # a refused one's recipes would all fail
    if framework == ANY and not any(f.schedules & ZERO_BUBBLE for f in able):  # no shape of them would be admitted
        features = set(features) - {"zero-bubble"}
    recipes = recipe_choices(able if framework == ANY else [], cluster, features)
    test = None
    if framework == ANY:
        given = options.get("assumptions", DEFAULT)
        options["assumptions"] = shared_costing(able, given)
        test = admissible(members(ANY), model, given)
        options["costings"], options["costing_key"], options["recompute_forms"] = test.costings, test.costing, test.forms
        options["microbatching"], options["forced_split"] = test.microbatching, test.split
    # the embedding / loss as pipeline layers: where a framework of the group states them (the theoretical optimum too)
    slots = framework == NONE or any(f.pipeline_slots for f in able)
    return Problem(model, cluster, fixed=fixed, features=frozenset(features), admissible=test, recipes=recipes,
                   pipeline_slots=slots, **options)


# Assumptions fields a framework's behaviour sets, and the configurations on which they change
# nothing: the deferred sync only a pipeline with ZeRO >= 2 (Context.deferred_sync), the gathered
# replicas only ZeRO-0 (terms_memory's replicas), FSDP2's dim-0 padding only states sharded over more
# than one rank (autoplace.cost.shards: a shard group of one stores each tensor whole), transformers'
# fp32 RMSNorm input only eager blocks (a compiled block keeps a fused kernel's: terms_memory)
IDLE_BEHAVIOUR: dict[str, Callable[[Config], bool]] = {
    "pipeline_defers_grad_sync": lambda c: c.pp == 1 or c.zero < 2,
    "replicas_keep_gathered": lambda c: c.zero != 0,
    "fsdp2_dim0_padding": lambda c: c.zero == 0 or c.dp_shard * c.cp == 1,
    "rmsnorm_upcast_kept": lambda c: bool(c.compile),
}


def shared_costing(group: Sequence[Framework], assumptions: Any) -> Any:
    """``assumptions`` for a search over ``group``'s recipes together: a fused loss in a plan
    that does not compile is the fused loss of a framework that fuses it without compiling
    (Megatron-LM's fuses the loss only; a compiled plan fuses the MLP whatever the loss).
    The plans found are judged again under each framework's own costing (:class:`Runners`)."""
    eager_fusers = [f for f in group
                    if True in f.recipes.get("fused_loss", ()) and True not in f.recipes.get("compile", ())]
    fuses = [f.behaviour.get("fused_loss_fuses_mlp", assumptions.fused_loss_fuses_mlp) for f in eager_fusers]
    return assumptions.replace(fused_loss_fuses_mlp=any(fuses)) if fuses else assumptions


# the best recipe some framework runs: what the theoretical optimum (--framework none) assumes
BEST_RECIPE = {"compile": True, "fused_loss": True, "tp_overlap": "async", "overlap": True}
SEARCHED_FP8 = ("tensorwise", "rowwise", "delayed")  # mxfp8 needs Blackwell's MX units: set it with --plan/--fix


def recipe_choices(group: Sequence[Framework], cluster: ClusterSpec, features: set[str]) -> tuple[dict[str, Any], ...]:
    """The recipes the search tries (``Problem.recipes``): per framework of ``group``, the first
    (best) value it declares of each key that changes no numerics (compile, fused_loss,
    tp_overlap, overlap) -- each is never slower and never takes more memory in the cost model
    (fewer bytes streamed and kernels, fewer activations, hidden collectives), so trying the
    worse value too would only double the space; ``BEST_RECIPE`` for an empty group (no
    framework).  With the fp8 feature, and only when every GPU of the cluster has fp8 units,
    each of those again with each fp8 recipe the framework implements."""
    fp8_ok = "fp8" in features and all(p.gpu.peak_TFLOPS.fp8 is not None for p in cluster.pools)
    out: list[dict[str, Any]] = []
    bests = ([(BEST_RECIPE, SEARCHED_FP8)] if not group else
             [({k: v[0] for k, v in f.recipes.items() if k != "fp8"}, f.recipes.get("fp8", ())) for f in group])
    # last, the defaults: what a shape is tried with when --fix makes its framework's best inexpressible
    # (torchtitan's fused loss and async TP need compile); enumeration skips it wherever a better one fits
    bests.append(({}, tuple(x for _, fp8s in bests for x in fp8s)))
    for best, fp8s in bests:
        for fp8 in ("none", *(x for x in fp8s if fp8_ok and x in SEARCHED_FP8)):
            choice = {**best, "fp8": fp8}
            if choice not in out:
                out.append(choice)
    return tuple(out)


def framework_problem(framework: Framework, model: ModelSpec, cluster: ClusterSpec, *, fixed: dict[str, Any],
                      features: set[str], **options: Any) -> Any:
    """The Problem of one framework: the model costed as it runs it, its pinned degrees and
    features, the configurations and recipes it expresses.

    Raises:
        Infeasible: the framework cannot train the model (its refusal names the feature).
    """
    from solvers.problem import Problem

    why = framework.model_refusal(model) or fixed_recipe_refusal(framework, model, fixed)
    if why:
        raise Infeasible(why)
    fixed, features = search_limits(framework, model, fixed, features)
    model, assumptions = framework.costing(model, options.pop("assumptions", DEFAULT))
    test = admissible([framework], model)
    return Problem(model, cluster, fixed=fixed, features=frozenset(features), admissible=test, assumptions=assumptions,
                   recipes=recipe_choices([framework], cluster, features), recompute_forms=test.forms,
                   microbatching=test.microbatching, forced_split=test.split, pipeline_slots=framework.pipeline_slots,
                   **options)


def fixed_recipe_refusal(framework: Framework, model: ModelSpec, fixed: dict[str, Any]) -> str | None:
    """Why ``framework`` can run no plan with the recipe keys ``fixed`` holds (by ``--fix`` or the
    model file's ``training.recipe``), naming which held it; None when its config states them all."""
    pins = model.training.recipe_pins.values()
    for key in (*RECIPE_KEYS, *SLOT_KEYS):
        why = recipe_refusal(framework, key, fixed[key]) if key in fixed else None
        if why:
            return f"{why}; pinned by " + (f"the model file's training.recipe.{key}" if key in pins else "--fix")
    return None


def admissible(group: Sequence[Framework], model: ModelSpec, assumptions: Any = DEFAULT) -> Admission:
    """A solver configuration filter (``Problem.admissible``): whether at least one framework of
    ``group`` can express the configuration (its degrees, ZeRO level, schedule and offload),
    judged on the configuration's plan with an even split and no recompute.  Per-layer recompute
    and uneven splits are judged on the final plans (:func:`refusal`)."""
    return Admission(group, model, assumptions)


class Admission:
    """Which frameworks of a group express a configuration (:func:`admissible`), how the search
    costs it (``Problem.costings`` / ``costing_key``): as the frameworks that express it run it
    when they cost alike (Megatron-LM alone: its fp32 gradients and kept SwiGLU inputs), else
    under the shared costing, whose plans :class:`Runners` judges again -- and the recompute
    its plans may take (``Problem.recompute_forms``): what those frameworks can state -- the
    micro-batchings they run (``Problem.microbatching``), and the split its plans must take
    (``Problem.forced_split``): the one those frameworks all make when none of them takes an
    explicit split (DeepSpeed's PipelineModule balances the blocks itself).  A search that chose
    such a configuration's split freely would find plans no framework runs and may leave out every
    plan one does (a DeepSpeed-only configuration's best split is rarely DeepSpeed's)."""

    def __init__(self, group: Sequence[Framework], model: ModelSpec, assumptions: Any = DEFAULT) -> None:
        from autoplace.cost.layers import layer_table

        able = [f for f in group if f.model_refusal(model) is None]
        # one group per distinct costing, Megatron-LM's first: it expresses nearly every
        # configuration some framework can in the default space
        self.costings: tuple[tuple[ModelSpec, Any], ...] = ()
        by_costing: dict[int, list[_Judge]] = {}
        for f in sorted(able, key=lambda f: f.name != "megatron"):
            costed = f.costing(model, assumptions)
            if costed not in self.costings:
                self.costings += (costed,)
            by_costing.setdefault(self.costings.index(costed) + 1, []).append(_Judge(f, f.config_check(model)))
        self._by_costing = by_costing
        # where a framework's behaviour changes nothing its costing is another's that differs only there
        # (torchtitan's and FSDP2's on ZeRO-2 without a pipeline): each costing's index with each set
        # of idle behaviours as given
        self._alike: dict[tuple[int, tuple[str, ...]], int] = {}
        for k in list(by_costing):
            costed_model, costed_assume = self.costings[k - 1]
            for idle in itertools.product(*[((), (name,)) for name in IDLE_BEHAVIOUR]):
                names = tuple(name for part in idle for name in part)
                alike = (costed_model, costed_assume.replace(**{name: getattr(assumptions, name) for name in names}))
                if alike not in self.costings:
                    self.costings += (alike,)
                self._alike[k, names] = self.costings.index(alike) + 1
        self._table = layer_table(model)
        self._no_recompute = (RECOMPUTE[0],) * self._table.blocks
        self._layouts: dict[tuple[int, int, bool, bool], tuple[int, ...]] = {}  # (pp, vpp, slots) -> blocks per stage
        self._splits: dict[tuple[str, int], tuple[int, ...] | None] = {}  # (framework, pp) -> its forced split
        # a framework that cannot state a configuration's recipe, or that runs one of its degrees
        # only at another value (FSDP2's pp=1), refuses it whatever else it holds: its check is
        # asked only of the configurations it may express, found by those values
        pinned = sorted({key for judges in by_costing.values() for j in judges for key in j.framework.pinned_degrees})
        self._screen_key = operator.attrgetter(*RECIPE_KEYS, *SLOT_KEYS, *pinned)
        self._screened: dict[tuple[Any, ...], list[tuple[int, list[_Judge]]]] = {}
        self._last: tuple[Config | None, _Verdict] = (None, (False, 0, 0, None, None))
        self._plan: tuple[Config | None, Plan | None] = (None, None)  # the last configuration's, built once
        self._batchings: dict[tuple[Any, ...], Callable[[int, int], bool]] = {}  # microbatching's rules

    def __call__(self, config: Config) -> bool:
        return self._judged(config)[0]

    def costing(self, config: Config) -> int:
        """The costing of ``config`` (``Problem.costing_key``): k >= 1 when the frameworks that
        express it all cost as ``costings[k - 1]``, else 0 (the shared costing)."""
        return self._judged(config)[1]

    def forms(self, config: Config) -> int:
        """The recompute forms of ``config``'s plans (``Problem.recompute_forms``): those some
        framework that expresses it can state (:func:`recompute_forms`)."""
        return self._judged(config)[2]

    def split(self, config: Config) -> tuple[int, ...] | None:
        """The split ``config``'s plans must take (``Problem.forced_split``): the one every framework
        that expresses it makes (:meth:`Framework.forced_split`), or None when one of them takes an
        explicit split -- or when two make different ones (none do today: then the search chooses,
        and the final check keeps the plans a framework runs)."""
        return self._judged(config)[4]

    def microbatching(self, config: Config) -> Callable[[int, int], bool] | None:
        """The micro-batchings of shape ``config`` (``Problem.microbatching``): None when a framework
        that expresses it runs every one, else whether one of those that do runs ``(mbs, grad_accum)``
        (:meth:`Framework.batching_refusal`)."""
        ruled = self._judged(config)[3]
        if ruled is None:
            return None
        # the rules read only pp, vpp, schedule and the micro-batching: one rule, and one verdict, per value
        key = (ruled, config.pp, config.vpp, config.schedule)
        if key not in self._batchings:
            verdicts: dict[tuple[int, int], bool] = {}

            def runs(mbs: int, ga: int) -> bool:
                if (mbs, ga) not in verdicts:
                    batched = config.with_micro_batching(mbs, ga)
                    verdicts[mbs, ga] = any(f.batching_refusal(batched) is None for f in ruled)
                return verdicts[mbs, ga]

            self._batchings[key] = runs
        return self._batchings[key]

    def expresses(self, config: Config) -> bool:
        """Whether a framework of the group runs ``config``, its shape and its micro-batching."""
        if not self(config):
            return False
        rule = self.microbatching(config)
        return rule is None or rule(config.mbs, config.grad_accum)

    def _judged(self, config: Config) -> _Verdict:
        """(whether a framework expresses ``config``, its costing, its recompute forms, and None when
        one of those that express it runs every micro-batching, else those frameworks, and its forced
        split), from the frameworks' verdicts."""
        if config is self._last[0]:  # the search asks a shape's costing, its forms, and whether it is admitted
            return self._last[1]
        costed: list[int] = []
        forms = 0
        ruled: list[Framework] = []  # frameworks that express it but run only some micro-batchings
        free = False  # one that runs every micro-batching expresses it
        any_split, forced = False, None  # one that takes any split expresses it; the split the others make
        for k, judges in self._screen(config):  # while a framework may add a costing (two: the shared one), a
            k = self._alike[k, tuple(name for name, idle in IDLE_BEHAVIOUR.items() if idle(config))]
            for judge in judges:  # form, or the micro-batchings or the split of those that express it are limited
                news = ((k not in costed and len(costed) < 2) or forms != 1 << PER_LAYER or bool(ruled and not free)
                        or not any_split)
                if news and judge.admits(config, self._plan_of):
                    if k not in costed:
                        costed.append(k)
                    forms = recompute_forms(judge.framework, config, forms)
                    free = free or not judge.framework.batching_rules
                    ruled += [judge.framework] if judge.framework.batching_rules else []
                    split = self._forced(judge.framework, config.pp)
                    any_split = any_split or split is None or forced not in (None, split)
                    forced = forced or split
        verdict = (bool(costed), costed[0] if len(costed) == 1 else 0, forms, None if free else tuple(ruled),
                   None if any_split else forced)
        self._last = (config, verdict)
        return verdict

    def _forced(self, framework: Framework, pp: int) -> tuple[int, ...] | None:
        """The split ``framework`` makes of this model's blocks into ``pp`` stages (None: the plan's own)."""
        key = (framework.name, pp)
        if key not in self._splits:
            self._splits[key] = framework.forced_split(self._table.blocks, pp) if pp > 1 else None
        return self._splits[key]

    def _screen(self, config: Config) -> list[tuple[int, list[_Judge]]]:
        """Per costing, the checks of the frameworks that may express ``config``: those that state its
        recipe and hold its pinned degrees (tests/test_frameworks.py: the others' checks refuse it)."""
        key = self._screen_key(config)
        if key not in self._screened:
            self._screened[key] = [
                (k, kept) for k, judges in self._by_costing.items()
                if (kept := [j for j in judges if unstated_recipe(config, j.framework) is None
                             and all(getattr(config, d) == v for d, v in j.framework.pinned_degrees.items())])]
        return self._screened[key]

    def _plan_of(self, config: Config) -> Plan:
        """``config``'s plan as the search judges it: an even split, no recompute."""
        judged, plan = self._plan
        if judged is not config or plan is None:
            plan = config.to_plan(self._layout(config), self._no_recompute)
            self._plan = (config, plan)
        return plan

    def _layout(self, config: Config) -> tuple[int, ...]:
        """Blocks per stage of the even split of ``config``'s whole model chunks
        (:func:`~autoplace.plan.split_units`: its pipeline depth, interleave and embedding / loss places)."""
        key = (config.pp, config.vpp, config.pp_embedding, config.pp_loss)
        if key not in self._layouts:
            self._layouts[key] = split_units(self._table.blocks, *key)
        return self._layouts[key]


# Admission's verdict on a shape: admitted, its costing, its recompute forms, the frameworks whose
# micro-batching rules limit it (None: one that expresses it runs every micro-batching), its forced
# split (None: the search chooses).  A plain tuple: the search judges tens of thousands of shapes
_Verdict = tuple[bool, int, int, "tuple[Framework, ...] | None", "tuple[int, ...] | None"]


class _Judge:
    """One framework's configuration check in a search, memoized by the fields it reads
    (:attr:`Framework.config_fields`) when it declares them: the search asks it of thousands of
    configurations that differ only in fields it does not read."""

    def __init__(self, framework: Framework, check: PlanCheck) -> None:
        self.framework, self.check = framework, check
        self._key = operator.attrgetter(*framework.config_fields) if framework.config_fields else None
        self._verdicts: dict[Any, bool] = {}

    def admits(self, config: Config, plan_of: Callable[[Config], Plan]) -> bool:
        """Whether the check admits ``config``'s plan (``plan_of(config)``, built only when asked)."""
        if self._key is None:
            return self.check(plan_of(config)) is None
        key = self._key(config)
        if key not in self._verdicts:
            self._verdicts[key] = self.check(plan_of(config)) is None
        return self._verdicts[key]


def recompute_forms(framework: Framework, config: Config, others: int = 0) -> int:
    """The recompute forms (``autoplace.plan.FORMS`` bits) ``framework`` can state for plans of
    ``config``, joined with ``others`` (another framework's): any mix per layer when either
    states it, else each mode it applies to every block, and full recompute on the first blocks
    (Megatron-LM's block method) without a pipeline -- which holds all-none and all-full."""
    if framework.layer_recompute == "any" or others == 1 << PER_LAYER:
        return 1 << PER_LAYER
    forms = others | sum(1 << RECOMPUTE.index(mode) for mode in framework.recompute_modes(config))
    if framework.layer_recompute == "first" and config.pp == 1:
        forms |= 1 << FIRST_FULL
    if forms & 1 << FIRST_FULL:
        forms &= ~(1 << RECOMPUTE.index("none") | 1 << RECOMPUTE.index("full"))
    return forms


def refusal(plan: Plan, model: ModelSpec, framework: str) -> str | None:
    """Why ``framework`` cannot run ``plan`` (its declaration's reason), or None.
    For ``any``: None when at least one framework can, else every framework's reason."""
    reasons = [f.refusal(plan, model) for f in members(framework)]
    return None if None in reasons else "; ".join(_clip(r) for r in reasons if r)


def _clip(reason: str, limit: int = 100) -> str:
    """A long reason as its first clause (whole words: piped output is never cut mid-word)."""
    return reason if len(reason) <= limit or "; " not in reason else reason.split("; ")[0]


class Runners:
    """Who runs plans of one model on one cluster.  A framework runs a plan when its config
    expresses the plan and the plan fits memory as the framework runs it (its costing: FSDP2's
    fp32 shards, Megatron's kept SwiGLU inputs, ...): a search under the default costing finds
    plans at the capacity edge that one framework expresses but runs out of memory with."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, assumptions: Any = DEFAULT,
                 group: Sequence[Framework] | None = None) -> None:
        self.model, self.cluster, self.assumptions = model, cluster, assumptions
        self.frameworks = [f for f in (members(ANY) if group is None else group) if f.model_refusal(model) is None]
        self.checks = {f.name: f.plan_check(model) for f in self.frameworks}
        self._costings: dict[str, tuple[ModelSpec, Any]] = {}

    def refusals(self, plans: Sequence[Plan]) -> list[dict[str, str | None]]:
        """Per plan: framework -> why it cannot run the plan, or None when it runs it."""
        return [{name: expressed[name] or fit[name] for name in expressed} for expressed, fit in self._judged(plans)]

    def unfit(self, plan: Plan) -> dict[str, str]:
        """The frameworks that express ``plan`` but run out of memory running it, with why."""
        [(_, fit)] = self._judged([plan])
        return {name: why for name, why in fit.items() if why}

    def of(self, plan: Plan) -> list[str]:
        """The frameworks that run ``plan``."""
        return [name for name, why in self.refusals([plan])[0].items() if why is None]

    def _judged(self, plans: Sequence[Plan]) -> list[tuple[dict[str, str | None], dict[str, str | None]]]:
        """Per plan: (framework -> why its config cannot express the plan, framework -> why the
        plan does not fit as it runs it; judged only where expressed), the fits of each
        framework's plans in one vectorized pass."""
        from autoplace.evaluation import evaluate_many

        out = [({name: check(plan) for name, check in self.checks.items()}, dict.fromkeys(self.checks))
               for plan in plans]
        for f in self.frameworks:
            todo = [i for i, (expressed, _) in enumerate(out) if expressed[f.name] is None]
            if not todo:
                continue
            if f.name not in self._costings:
                self._costings[f.name] = f.costing(self.model, self.assumptions)
            costed, assumptions = self._costings[f.name]
            evs = evaluate_many(costed, self.cluster, [plans[i] for i in todo], assumptions)
            for i, ev in zip(todo, evs, strict=True):
                out[i][1][f.name] = None if ev.fits else _unfit(f, ev)
        return out


def runnable_by(plan: Plan, model: ModelSpec, cluster: ClusterSpec, assumptions: Any = DEFAULT) -> list[str]:
    """The frameworks that run ``plan`` (:class:`Runners`)."""
    return Runners(model, cluster, assumptions).of(plan)


def _unfit(framework: Framework, ev: Any) -> str:
    """Why ``ev``'s plan does not fit as ``framework`` runs it (device memory, else host memory)."""
    gib = 2**30
    if ev.memory["total"] > ev.memory["capacity"]:
        return (f"{framework.name}: out of memory as {framework.title} runs it ({ev.memory['total'] / gib:.1f} GiB "
                f"per GPU of {ev.memory['capacity'] / gib:.1f})")
    return (f"{framework.name}: out of host memory as {framework.title} runs it ({ev.host['offloaded'] / gib:.1f} "
            f"GiB per GPU of {ev.host['capacity'] / gib:.1f})")


def solve_for(group: Sequence[Framework], solver: Any, problem: Any, budget: Any, top: int,
              framework: str | None = None) -> Any:
    """Solve ``problem`` (from :func:`problem_for`) and keep the ``top``
    plans at least one framework of ``group`` can express.

    The search gives each configuration's plans only the recompute the frameworks that express
    it can state (``Problem.recompute_forms``) and the split they make when they take none
    (``Problem.forced_split``), and asks for ``2 * top`` plans (at most 20) because a plan may
    still be one no framework of the group runs (memory as the framework runs it, under the
    shared costing); a note counts those left out, and it searches deeper while fewer than
    ``top`` are kept.

    Args:
        framework: the name the user gave (``any`` or one framework), for messages.
    """
    from solvers.problem import objective_key

    who = framework or ", ".join(f.name for f in group)
    runners = Runners(problem.model, problem.cluster, problem.assumptions, group)  # every search below: one model
    wide = dataclasses.replace(problem, top_k=min(20, 2 * top))
    deadline = time.perf_counter() + budget.time_limit_s  # --time-limit bounds every solve below together
    results = [_solve_run(solver, wide, budget, who, deadline)]
    kept, reasons, plans = _keep(results, problem, runners)
    while len(kept) < top and _more_to_find(results, wide) and deadline - time.perf_counter() > 0.5:
        wide = dataclasses.replace(wide, top_k=3 * wide.top_k)  # look deeper: top-K means K runnable plans
        results.insert(0, _solve_run(solver, wide, budget, who, deadline))
        kept, reasons, plans = _keep(results, problem, runners)
    notes = [note for r in results for note in r.notes]
    if reasons:
        nobody = "no supported framework can" if framework == ANY else f"{who} cannot"
        notes.append(f"{len(reasons)} of the {len(plans)} best plans left out: {nobody} run them "
                     f"(e.g. {reasons[0]})")
    if 0 < len(kept) < top:
        why = ("the time limit ended the search for more" if _more_to_find(results, wide)
               else f"no other configuration that fits can be run by {'any framework' if framework == ANY else who}")
        notes.append(f"{len(kept)} of the {top} plans asked for: {why}")
    proven = all(r.status in ("optimal", "infeasible") for r in results)
    status = ("optimal" if proven else "feasible") if kept else (
        "unknown" if any(r.status == "unknown" for r in results) else "infeasible")
    phases: dict[str, float] = {}
    for r in results:
        for name, seconds in r.phases.items():
            phases[name] = phases.get(name, 0.0) + seconds
    # proven: the best plan kept is the runnable optimum (every better plan was found and left
    # out), so it is the bound; else the searches' weakest bound, which holds for what they left out
    bounds = [r.bound for r in results if r.status not in ("infeasible", "unknown")]
    bound = (objective_key(kept[0], problem.objective)[0] if status == "optimal" else
             min(bounds) if bounds and None not in bounds else None)
    return dataclasses.replace(results[0], plans=kept[:top], status=status, notes=notes, bound=bound,
                               wall_s=sum(r.wall_s for r in results),
                               n_evaluated=sum(r.n_evaluated for r in results), phases=phases)


def _more_to_find(results: list[Any], wide: Any) -> bool:
    """Whether a deeper search may find more plans: some search returned as many as it was asked for."""
    return any(len(r.plans) >= wide.top_k for r in results if r.status != "infeasible")


def _solve_run(solver: Any, problem: Any, budget: Any, who: str, deadline: float) -> Any:
    """One solve within the deadline; an empty admissible space says whose."""
    try:
        result = solver.solve(problem, dataclasses.replace(budget, time_limit_s=max(deadline - time.perf_counter(), 0.1)))
        if problem.top_k > 20:  # a deeper search says which it was
            result = dataclasses.replace(result, notes=[f"top {problem.top_k}: {n}" for n in result.notes])
        return result
    except Infeasible as exc:
        whose = "some supported framework" if who == ANY else who
        raise Infeasible(f"{exc}, among the configurations {whose} can run (--framework none shows the "
                         "theoretical optimum)") from None


def _keep(results: list[Any], problem: Any, runners: Runners) -> tuple[list[Any], list[str], list[Any]]:
    """(plans a framework of ``runners`` runs -- expresses, and fits as it runs them -- best first
    and distinct; reasons for the others; all plans)."""
    from solvers.problem import objective_key

    plans = sorted((ev for r in results for ev in r.plans), key=lambda ev: objective_key(ev, problem.objective))
    distinct, seen = [], set()
    for ev in plans:
        if ev.plan.to_string() not in seen:
            seen.add(ev.plan.to_string())
            distinct.append(ev)
    verdicts = runners.refusals([ev.plan for ev in distinct])
    kept, reasons = [], []
    for ev, why in zip(distinct, verdicts, strict=True):
        if None in why.values():
            kept.append(ev)
        else:
            reasons.append("; ".join(_clip(r) for r in why.values() if r))
    return kept, reasons, plans


def solve(framework: str, solver: Any, problem: Any, budget: Any, top: int) -> Any:
    """The search ``solve --framework`` asks for: unfiltered for ``none``, else the plans the
    framework (or, for ``any``, at least one framework) can express."""
    if framework == NONE:
        return solver.solve(problem, budget)
    return solve_for(members(framework), solver, problem, budget, top, framework)


def best_per_framework(model: ModelSpec, cluster: ClusterSpec, solver: Any, budget: Any, *, fixed: dict[str, Any],
                       features: set[str], fallback: Plan | None = None, depth: int = 1,
                       pick: Callable[[Any, Any], Any] | None = None, **options: Any) -> dict[str, tuple[Any, Any]]:
    """Each framework's best plan, costed as it runs it: name -> (Evaluation, costed model), or
    (None, why there is none); the frameworks share ``budget``'s time limit, and once it is spent
    the rest are not searched: each gets ``fallback`` (the overall best plan) costed as it runs it
    when it can run it, else the reason says it was not searched.  A framework whose search the
    time limit cut short keeps ``fallback`` too when it runs it faster than the plan it found.

    Args:
        depth, pick: how many plans each framework's search returns, and which of them it keeps
            (``pick(result, problem)`` -> the result whose first plan is kept: the ranking solve
            uses, :func:`autoplace.ranking.rerank`); by default its fastest.

    Each framework is searched alone: a search shared by several frameworks keeps each
    configuration's best plan, which may be one that only another framework runs, so the first
    plan a framework can run in a shared list is its optimum only when it heads the list.
    """
    out: dict[str, tuple[Any, Any]] = {}
    deadline = time.perf_counter() + budget.time_limit_s
    names = list(FRAMEWORKS)
    assume = options.get("assumptions", DEFAULT)
    for k, name in enumerate(names):
        left = (deadline - time.perf_counter()) / (len(names) - k)
        if left <= 0:  # the time limit bounds the whole command: say so rather than overrun it
            refused = get(name).model_refusal(model)  # a model it cannot train: that, whatever the time
            out[name] = (None, refused) if refused else (_fallback_for(get(name), model, cluster, fallback, assume) or (
                None, f"not searched: the time limit was spent before {name}'s own search (--time-limit)"))
            continue
        try:
            problem = problem_for(name, model, cluster, top_k=depth, fixed=dict(fixed), features=set(features),
                                  **options)
            result = solve_for([get(name)], solver, problem, dataclasses.replace(budget, time_limit_s=left), depth, name)
            result = pick(result, problem) if pick else result
        except AutoplaceError as exc:
            out[name] = (None, exc)
            continue
        # a search the time limit cut short can miss the overall best plan it runs
        seed = None if result.status == "optimal" else _fallback_for(get(name), model, cluster, fallback, assume)
        if result.plans and (seed is None or result.plans[0].step_time_s <= seed[0].step_time_s):
            out[name] = (result.plans[0], problem.model)
        elif seed is not None:
            out[name] = seed
        else:
            detail = next((n for n in result.notes if "left out" in n), "; ".join(result.advice) or "no plan fits")
            out[name] = (None, f"no plan {name} can express fits ({detail})")
    return out


def _fallback_for(framework: Framework, model: ModelSpec, cluster: ClusterSpec, fallback: Plan | None,
                  assume: Any) -> tuple[Any, Any] | None:
    """``fallback`` costed as ``framework`` runs it, with that costed model, when it can run it
    and it fits so costed; else None."""
    from autoplace.evaluation import evaluate

    if fallback is None or framework.refusal(fallback, model) is not None:
        return None
    costed, assumptions = framework.costing(model, assume)
    ev = evaluate(costed, cluster, fallback, assumptions)
    return (ev, costed) if ev.ok else None
