"""The placement space: every valid configuration of degrees, sharding, offload, micro-batch
and schedule, scored in one vectorized pass, with sound bounds for pruning.

A *configuration* fixes everything but the per-layer decisions (the layer-to-stage split and
each block's recompute mode); those are what CP-SAT decides per configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoplace.compression import CHOICES, applies
from autoplace.cost.candidates import Candidates, pack
from autoplace.cost.evaluate import evaluate_batch
from autoplace.cost.layers import LayerTable, layer_table
from autoplace.cost.terms import StageTerms, stage_terms
from autoplace.errors import Infeasible, SpecError
from autoplace.plan import (
    FIRST_FULL,
    FORMS,
    MULTI_CHUNK,
    PER_LAYER,
    RECIPE_DEFAULTS,
    RECOMPUTE,
    ZERO_BUBBLE,
    Config,
    Plan,
    schedule_batching,
    split_units,
)
from autoplace.specs.model import TransformerSpec
from solvers.bounds import Summary, summarize
from solvers.problem import Problem


@functools.cache
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def enumerate_configs(problem: Problem, deadline: float | None = None) -> ConfigList:
    """Every configuration the rules allow, honouring ``problem.fixed``, with their arrays.

    Args:
        deadline: a ``time.perf_counter()`` value: past it, enumeration stops at the next set of
            degrees that leaves at least one configuration enumerated, and the list says
            :attr:`ConfigList.stopped` (the time limit bounds the whole solve).

    Raises:
        Infeasible: when the fixed keys leave nothing (with the reason).
    """
    with _collector_paused():
        return _enumerate(problem, math.inf if deadline is None else deadline)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector.  Enumeration makes tens of thousands of small objects
    that form no cycles; as they pile up the collector walks them, and every other object of the
    process, to free nothing (on Mixtral-8x7B / 256 GPUs a full collection, ~25 ms, a sixth of
    the phase, that the rest of the solve does not make up for)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _enumerate(problem: Problem, deadline: float) -> ConfigList:
    m, c, fx, feat = problem.model, problem.cluster, problem.fixed, problem.features
    table = layer_table(m)
    W, G, L, B = c.gpus, c.nvlink_domain, table.blocks, m.training.global_batch  # G: GPUs on one NVLink fabric
    seq = table.seq_len

    def allowed(key: str, values: list[int]) -> list[int]:
        return [v for v in values if v == fx[key]] if key in fx else values

    tps = allowed("tp", [t for t in _divisors(W) if t <= G or "tp-across-nodes" in feat])
    if isinstance(m, TransformerSpec):
        tps = [t for t in tps if m.heads % t == 0 and m.ffn_hidden % t == 0
               and (m.n_kv_heads % t == 0 or t % m.n_kv_heads == 0)]
    cps = allowed("cp", [x for x in _divisors(W) if x == 1 or ("cp" in feat and x <= 16 and seq % (2 * x) == 0)])
    experts = m.moe.experts if isinstance(m, TransformerSpec) and m.moe else 1
    reduce_bytes = m.training.recipe().reduce_bytes
    split = problem.fixed_split
    if split is not None and (sum(split) != L or min(split) < 0):
        raise SpecError(f"needs counts (one per pipeline stage) adding up to the model's {L} layers, got "
                        f"{fx['layers']}", source="--fix", field="layers")
    out = _Listing()
    recipes: dict[bool, Ranked] = {}  # by tp > 1, all _recipes reads of the degrees
    for tp, cp in itertools.product(tps, cps):
        if W % (tp * cp):
            continue
        for pp in allowed("pp", [p for p in _divisors(W // (tp * cp)) if p <= L and (split is None or p == len(split))]):
            dp = W // (tp * cp * pp)
            if "dp" in fx and fx["dp"] != dp:
                continue
            if B % dp or (tp > 1 and (seq // cp) % tp):
                continue
            eps = allowed("ep", [e for e in _divisors(experts) if (dp * cp) % e == 0 and (e == 1 or "ep" in feat)])
            for ep, zero in itertools.product(eps, allowed("zero", [0, 1, 2, 3])):
                for dp_rep, dp_shard in _dp_splits(dp, zero, G // (tp * cp) if tp * cp <= G else 1, fx, feat):
                    base = Config(tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=dp_rep, dp_shard=dp_shard, sp=tp > 1,
                                  zero=zero)
                    if (tp > 1) not in recipes:
                        recipes[tp > 1] = _ranked(_recipes(problem, base))
                    out.add(*_micro(problem, L, B, dp, base, reduce_bytes, recipes[tp > 1]))
                    if out.configs and time.perf_counter() > deadline:
                        return out.done(stopped=True)
    if not out.configs:
        raise Infeasible("no configuration satisfies the fixed keys and the composition rules "
                         f"({', '.join(f'{k}={v}' for k, v in fx.items()) or 'no keys fixed'}; {W} GPUs, {L} layers)")
    return out.done()


def _dp_splits(dp: int, zero: int, node_dp: int, fx: dict[str, Any], feat: frozenset[str]) -> list[tuple[int, int]]:
    if zero == 0:
        splits = [(dp, 1)]
    else:
        splits = [(1, dp)]
        if zero == 3 and "hsdp" in feat and 1 < node_dp < dp and dp % node_dp == 0:
            splits.append((dp // node_dp, node_dp))
    return [(r, s) for r, s in splits
            if fx.get("dp_replicate", r) == r and fx.get("dp_shard", s) == s]


Label = tuple[int, int, tuple[int, ...] | None]  # a shape's costing index, recompute forms and forced split


def _micro(problem: Problem, L: int, B: int, dp: int, base: Config, reduce_bytes: float,
           recipes: Ranked) -> tuple[list[Config], list[tuple[int, int, list[int]]], list[Label]]:
    """The micro-batching, interleaving and offload choices of one set of degrees: every
    micro-batch that divides the per-replica batch (``Problem.max_mbs`` caps it when set), every
    interleave ``v`` that divides the blocks into ``v`` chunks per stage, with the micro-batches a
    multiple of pp (Megatron-LM's and PyTorch's interleaved schedules require it); only the
    shapes ``problem.admissible`` accepts, each with the micro-batchings its frameworks run
    (``problem.microbatching``).

    Args:
        recipes: the recipe alternatives of ``base`` (:func:`_recipes`), ranked (:func:`_ranked`).

    Returns:
        The shapes (everything but the micro-batching: ``base`` with the choices, at mbs=1),
        per micro-batching (mbs, grad_accum) the indices of the shapes it applies to, and each
        shape's costing (:meth:`Problem.costing_index`; a recipe dominates only those costed alike),
        recompute forms (:meth:`Problem.forms`) and forced split (:meth:`Problem.split_of`).
    """
    fx, feat, pp = problem.fixed, problem.features, base.pp
    per_replica = B // dp
    mbss = [b for b in _divisors(per_replica) if problem.max_mbs is None or b <= problem.max_mbs]
    if "mbs" in fx:
        mbss = [fx["mbs"]] if per_replica % fx["mbs"] == 0 else []
    layouts = _layouts(problem, L, pp)
    zb = "zero-bubble" in feat or fx.get("schedule") in ZERO_BUBBLE
    multi = ("interleaved", "zbv") if zb else ("interleaved",)  # the least a multi-chunk one needs (dualpipev: zbv's)
    if all(schedule_batching(s, pp, per_replica // mbs) for mbs in mbss for s in multi):
        layouts = [x for x in layouts if x[0] == 1]  # no micro-batching runs several chunks: no shape would be used
    offs_opt = ["none", "cpu"] if ("offload" in feat and base.zero >= 1) else ["none"]
    offs_par = ["none", "cpu"] if ("offload" in feat and base.zero == 3) else ["none"]
    # the shapes a framework can express, judged once each: no emitter check reads mbs or
    # grad_accum (tests/test_emit_solve_frameworks.py)
    compressions = _compressions(problem, base, reduce_bytes)
    shapes: list[Config] = []
    labels: list[Label] = []  # each shape's Problem.costing_index, Problem.forms and Problem.split_of
    batching: list[Any] = []  # each shape's Problem.microbatching rule (None: every micro-batching)
    for (vpp, embedding, loss), schedule in ((x, s) for x in layouts for s in _schedules(problem, base.ep, *x)):
        for oo, op, (comp, rank) in itertools.product(offs_opt, offs_par, compressions):
            if fx.get("offload_optimizer", oo) != oo or fx.get("offload_params", op) != op:
                continue
            taken: dict[int, int] = {}  # the recipes admitted (their indices), with their costings
            choices = {"vpp": vpp, "schedule": schedule, "offload_optimizer": oo, "offload_params": op,
                       "compress": comp, "powersgd_rank": rank, "pp_embedding": embedding, "pp_loss": loss}
            for i, (recipe, dominators) in enumerate(recipes):  # best first: a recipe no better than one
                better = [taken[j] for j in dominators if j in taken]  # admitted and costed alike is left out
                if better and not problem.costings:
                    continue
                shape = base.replaced(choices | recipe)
                costing = problem.costing_index(shape)
                if costing in better:
                    continue
                if problem.admissible is None or problem.admissible(shape):
                    shapes.append(shape)
                    labels.append((costing, problem.forms(shape), problem.split_of(shape)))
                    batching.append(None if problem.microbatching is None else problem.microbatching(shape))
                    taken[i] = costing
    ruled = any(rule is not None for rule in batching)
    batchings = []
    for mbs in mbss:  # micro-batch outermost: the order configurations (and ties) always had
        ga = per_replica // mbs
        fits = {s: pp == 1 or schedule_batching(s, pp, ga) is None for s in {shape.schedule for shape in shapes}}
        chosen = [k for k, shape in enumerate(shapes) if fits[shape.schedule]]
        if ruled:
            chosen = [k for k in chosen if batching[k] is None or batching[k](mbs, ga)]
        batchings.append((mbs, ga, chosen))
    return shapes, batchings, labels


def _schedules(problem: Problem, ep: int, vpp: int, embedding: bool, loss: bool) -> list[str]:
    """The pipeline schedules of one layout (:func:`_layouts`) as ``--fix`` allows: the one chunk a
    rank schedules (1f1b unless pinned), or interleaved 1F1B and with the zero-bubble feature
    interleaved-zb, and the V schedules at two chunks a rank without a loss place
    (autoplace.rules): zbv, and dualpipev with expert parallelism (``ep`` > 1) or pinned.  Without
    an all-to-all to hide, dualpipev is ZB-V's placement with a larger bubble and half a micro-batch
    more in flight (autoplace.cost.step.BUBBLE_SHARE, cost.memory.inflight_microbatches): never better."""
    fx = problem.fixed
    if vpp == 1:
        out = [fx.get("schedule", "1f1b")]
    else:
        out = ["interleaved"]
        if "zero-bubble" in problem.features or fx.get("schedule") in ZERO_BUBBLE:
            v = vpp == 2 and not loss  # autoplace.rules: a V takes the embedding's place, not the loss's
            dual = v and (ep > 1 or fx.get("schedule") == "dualpipev")
            out += ["interleaved-zb", *(["zbv"] if v else []), *(["dualpipev"] if dual else [])]
    return [s for s in out if fx.get("schedule", s) == s and (s in MULTI_CHUNK) == (vpp > 1)]


def _layouts(problem: Problem, L: int, pp: int) -> list[tuple[int, bool, bool]]:
    """The (vpp, pp_embedding, pp_loss) of one pipeline depth: no interleave, and with the interleave
    feature every ``v`` that cuts each stage's units into chunks -- the blocks alone, and (where the
    problem tries them, :attr:`Problem.pipeline_slots`) the blocks with the embedding and / or the
    loss counted as layers (:func:`autoplace.plan.stage_slots`) where that makes an interleave the
    blocks alone do not (126 layers in 8 x 8 chunks) -- as ``--fix`` allows.  The search counts the
    two together, as Megatron-LM's recipes set the two flags (NVIDIA's Llama-3.1-405B); one alone,
    or places at every interleave, when ``--fix`` pins them."""
    fx = problem.fixed
    pinned = bool(fx.get("pp_embedding") or fx.get("pp_loss"))
    places = [(False, False)]
    if pp > 1 and (problem.pipeline_slots or pinned):
        places += [(True, False), (False, True), (True, True)] if pinned else [(True, True)]
    places = [(e, l_) for e, l_ in places if fx.get("pp_embedding", e) == e and fx.get("pp_loss", l_) == l_]
    # without interleaving a place only moves the even split, which the search chooses anyway: tried when pinned
    out = [(1, e, l_) for e, l_ in places if fx.get("vpp", 1) == 1 and (pinned or not (e or l_))]
    if "interleave" in problem.features or "vpp" in fx or fx.get("schedule") in MULTI_CHUNK:
        for e, l_ in places:
            units = L + e + l_
            # an interleave the blocks alone make is searched without places unless they are pinned: a
            # place moves one block at an end, where the split's own choice of sizes already moves v
            out += [(v, e, l_) for v in _divisors(units)[1:] if pp > 1 and units // v >= pp
                    and fx.get("vpp", v) == v and (pinned or not (e or l_) or L % v)]
    return out


def _recipes(problem: Problem, base: Config) -> list[dict[str, Any]]:
    """The recipe alternatives of one set of degrees (``Problem.recipes`` with ``--fix``'s recipe
    keys over them), distinct; TP-comm overlap only where there is tensor parallelism."""
    out: list[dict[str, Any]] = []
    for recipe in problem.recipes:
        values = {**RECIPE_DEFAULTS, **recipe, **{k: v for k, v in problem.fixed.items() if k in RECIPE_DEFAULTS}}
        if base.tp == 1 and "tp_overlap" not in problem.fixed:
            values["tp_overlap"] = "none"
        if values["fp8"] != "none":
            plain = [p.gpu.name for p in problem.cluster.pools if p.gpu.peak_TFLOPS.fp8 is None]
            if plain:
                raise Infeasible(f"fp8={values['fp8']}: {plain[0]} has no fp8 units (its profile states no fp8 peak)")
        if values not in out:
            _check_recipe(tuple(values.items()))  # the shapes take it unchecked
            out.append(values)
    return sorted(out, key=lambda r: -sum(_on(r).values()))


Ranked = list[tuple[dict[str, Any], tuple[int, ...]]]  # recipes, best first, each with its dominators' indices


def _ranked(recipes: list[dict[str, Any]]) -> Ranked:
    """Each recipe (best first) with the indices of the earlier ones that dominate it (:func:`_dominates`)."""
    return [(r, tuple(j for j in range(i) if _dominates(recipes[j], r))) for i, r in enumerate(recipes)]


@functools.cache
def _check_recipe(values: tuple[tuple[str, Any], ...]) -> None:
    """Raise SpecError for recipe values no Config may hold (checked once per distinct recipe)."""
    Config(**dict(values))


def _on(recipe: dict[str, Any]) -> dict[str, bool]:
    """Which of a recipe's numerics-neutral keys are on (async TP and userbuffers cost alike)."""
    return {"compile": recipe["compile"], "fused_loss": recipe["fused_loss"], "overlap": recipe["overlap"],
            "tp_overlap": recipe["tp_overlap"] != "none"}


def _dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether recipe ``a`` is never slower nor larger than ``b`` in the cost model: the same fp8
    recipe and every key ``b`` turns on on in ``a`` (each is, for the same configuration)."""
    on_a, on_b = _on(a), _on(b)
    return a["fp8"] == b["fp8"] and all(on_a[k] or not on_b[k] for k in on_a)


def _compressions(problem: Problem, base: Config, reduce_bytes: float) -> list[tuple[str, int]]:
    """The (compress, powersgd_rank) choices of one set of degrees: none, and with the compress
    feature every option that applies to them (:func:`autoplace.compression.applies`) under a
    recipe that reduces gradients in ``reduce_bytes``-byte words."""
    fx = problem.fixed
    searched = "compress" in problem.features or fx.get("compress", "none") != "none"
    options = CHOICES if searched else CHOICES[:1]
    return [(c, r) for c, r in options
            if fx.get("compress", c) == c and fx.get("powersgd_rank", r) == r
            and applies(base.replaced({"compress": c, "powersgd_rank": r}), reduce_bytes)]  # CHOICES: valid


class _Listing:
    """The configurations as enumeration finds them, each an admitted shape with a micro-batching."""

    def __init__(self) -> None:
        self.labels: list[Label] = []  # each shape's Problem.costing_index, Problem.forms and Problem.split_of
        self.shapes: list[Config] = []
        self.configs: list[Config] = []
        self.rows: list[int] = []  # each configuration's shape (an index into shapes)
        self.mbs: list[int] = []
        self.ga: list[int] = []

    def add(self, shapes: list[Config], batchings: list[tuple[int, int, list[int]]],
            labels: list[Label]) -> None:
        """The configurations of one set of degrees (:func:`_micro`'s shapes, batchings, and the shapes'
        costings, forms and forced splits)."""
        first = len(self.shapes)
        self.shapes.extend(shapes)
        self.labels.extend(labels)
        for mbs, ga, chosen in batchings:
            self.configs.extend(shapes[k].with_micro_batching(mbs, ga) for k in chosen)
            self.rows.extend([first + k for k in chosen])
            self.mbs.extend([mbs] * len(chosen))
            self.ga.extend([ga] * len(chosen))

    def done(self, stopped: bool = False) -> ConfigList:
        """The configurations with their arrays: the shapes' (packed once each), taken per configuration."""
        shapes = pack(self.shapes, np.zeros((len(self.shapes), 0, 0, 3)))
        rows = np.array(self.rows, dtype=np.int64)
        arrays = dataclasses.replace(shapes.take(rows), mbs=np.array(self.mbs, dtype=np.int64),
                                     ga=np.array(self.ga, dtype=np.int64))
        costing, forms = np.array([label[:2] for label in self.labels], dtype=np.int64).reshape(-1, 2)[rows].T
        return ConfigList(self.configs, arrays, stopped=stopped, costing=costing, forms=forms,
                          splits=[self.labels[r][2] for r in self.rows])


class ConfigList(list[Config]):
    """Configurations in enumeration order with their struct-of-arrays view, :attr:`arrays`
    (:class:`Candidates` without block counts), built from the few thousand shapes they were
    enumerated from: :func:`to_candidates` takes rows of it instead of reading the attributes
    of tens of thousands of configurations.  Read it as a list: the arrays describe the list
    as enumerated.  :attr:`stopped`: the time limit ended enumeration before the whole space.

    Each configuration has its costing (:meth:`Problem.costing_index`), recompute forms
    (:meth:`Problem.forms`) and forced split (:meth:`Problem.split_of`, :attr:`splits`);
    :meth:`by_form` lists it once per form, :attr:`form` says which."""

    def __init__(self, configs: list[Config], arrays: Candidates, stopped: bool = False,
                 costing: np.ndarray | None = None, forms: np.ndarray | None = None,
                 form: np.ndarray | None = None, splits: list[tuple[int, ...] | None] | None = None) -> None:
        super().__init__(configs)
        self.arrays = arrays
        self.stopped = stopped
        n = len(configs)
        self.costing = np.zeros(n, dtype=np.int64) if costing is None else costing  # Problem.costing_index
        self.forms = np.full(n, 1 << PER_LAYER, dtype=np.int64) if forms is None else forms  # Problem.forms
        self.form = np.full(n, PER_LAYER, dtype=np.int64) if form is None else form  # the one each row takes
        self.splits = [None] * n if splits is None else splits  # Problem.split_of

    def subset(self, rows: Sequence[int] | np.ndarray) -> ConfigList:
        """The configurations ``rows``, in that order, with their arrays."""
        rows = np.asarray(rows, dtype=np.int64)
        return ConfigList([self[i] for i in rows], self.arrays.take(rows), self.stopped, self.costing[rows],
                          self.forms[rows], self.form[rows], [self.splits[i] for i in rows])

    def by_form(self) -> tuple[ConfigList, np.ndarray]:
        """Each configuration once per recompute form it may take (forms in :data:`FORMS` order),
        :attr:`form` set, and each row's index into this list."""
        if (self.forms == 1 << PER_LAYER).all():
            return self, np.arange(len(self))
        rows, form = np.nonzero((self.forms[:, None] >> np.array(FORMS)) & 1)
        out = self.subset(rows)
        out.form = np.array(FORMS)[form]
        return out, rows


def recompute_of(configs: Sequence[Config], i: int, pinned: int | None) -> int | None:
    """The recompute configuration ``i``'s tables take: a mode (RECOMPUTE's index), FIRST_FULL,
    or None for any mix per layer (``pinned``, the problem's pinned mode, when it has one)."""
    form = int(configs.form[i]) if isinstance(configs, ConfigList) else PER_LAYER
    return pinned if form == PER_LAYER else form


def split_of(configs: Sequence[Config], i: int, problem: Problem) -> tuple[int, ...] | None:
    """The split configuration ``i``'s plans must take (:meth:`Problem.split_of`), as enumeration
    labelled it, or None when the search chooses it."""
    if isinstance(configs, ConfigList) and "layers" not in problem.fixed:
        return configs.splits[i]
    return problem.split_of(configs[i])


def to_candidates(configs: Sequence[Config], table: LayerTable, mode: int = 0,
                  rows: Sequence[int] | np.ndarray | None = None,
                  splits: Sequence[tuple[int, ...] | None] | None = None) -> Candidates:
    """Configurations (the ``rows`` of ``configs``, or all) as arrays, each with one recompute mode
    everywhere, on an even split -- or on ``splits[k]`` (blocks per stage) where it is not None."""
    if isinstance(configs, ConfigList):  # taken from its arrays, not packed
        cand = configs.arrays if rows is None else configs.arrays.take(np.asarray(rows, dtype=np.int64))
    else:
        chosen = configs if rows is None else [configs[i] for i in rows]
        cand = pack(chosen, np.zeros((len(chosen), 0, 0, 3)))
    counts = _even_counts(cand, table, mode)
    given = list(splits or ())
    for split in {sp for sp in given if sp is not None}:
        counts[[k for k, sp in enumerate(given) if sp == split]] = _split_counts(split, counts.shape[1], table, mode)
    return dataclasses.replace(cand, counts=counts)


def _split_counts(split: tuple[int, ...], depth: int, table: LayerTable, mode: int) -> np.ndarray:
    """Block counts ``[S, K, 3]`` (S = ``depth`` stages, the deepest of a batch) of one split,
    contiguous as :func:`_even_counts` lays them, with recompute ``mode`` everywhere."""
    seq, K = np.asarray(table.sequence), len(table.kinds)
    out = np.zeros((depth, K, 3))
    for s, (start, n) in enumerate(zip(np.cumsum((0, *split[:-1])), split, strict=True)):
        out[s, :, mode] = np.bincount(seq[start:start + n], minlength=K)
    return out


def _even_counts(cand: Candidates, table: LayerTable, mode: int) -> np.ndarray:
    """Block counts ``[C, S, K, 3]`` (S: the deepest pipeline) of candidates with pipeline depths
    ``pp``, interleaves ``vpp`` and embedding / loss places: their even split
    (:func:`autoplace.plan.split_units`) with recompute ``mode`` everywhere."""
    pp = cand.pp
    S, K = int(pp.max()), len(table.kinds)
    seq = np.asarray(table.sequence)
    keys = np.stack([pp, cand.vpp, cand.pp_embedding, cand.pp_loss], axis=1)
    layouts, which = np.unique(keys, axis=0, return_inverse=True)
    grids = np.zeros((len(layouts), S, K))
    for g, (depth, v, embedding, loss) in enumerate(layouts.tolist()):  # one per layout, shared by its candidates
        start = 0
        for s, n in enumerate(split_units(table.blocks, depth, v, bool(embedding), bool(loss))):
            grids[g, s] = np.bincount(seq[start:start + n], minlength=K)
            start += n
    counts = np.zeros((len(pp), S, K, 3))
    counts[:, :, :, mode] = grids[which.ravel()]
    return counts


@dataclass(frozen=True)
class Scored:
    """Configurations with their coefficient tables (:func:`autoplace.cost.terms.stage_terms`),
    indexed 0..len-1: what the searches read."""

    configs: list[Config]
    table: LayerTable
    terms: StageTerms


# configurations scored per numpy pass, and configuration-stages: they bound the arrays' size (a
# pass costs ~5 ms besides its rows, so no finer than that: 4,096 rows split DeepSeek-V3's
# 1,024-GPU costings at every depth into 4,096 and a few hundred)
GROUP_ROWS = 8192
GROUP_CELLS = 8192 * 32


@dataclass(frozen=True)
class Space:
    """The whole space bounded: every configuration, once per recompute form it may take
    (:meth:`ConfigList.by_form`), and their sound lower bounds.  Coefficient tables are built
    on demand for the few configurations a search visits (:meth:`scored`), so the
    [configurations x stages] arrays of the whole space are never held at once."""

    problem: Problem
    configs: list[Config]
    table: LayerTable
    lower_bound: np.ndarray  # [C] objective lower bound over all inner choices
    memory_lb: np.ndarray  # [C] lower bound of the fullest stage's memory minus capacity (> 0: cannot fit)
    summary: Summary  # what the bounds of any objective and recompute mode read, per configuration listed
    listed: list[Config]  # the configurations as enumerated (the summary's rows)

    @staticmethod
    def of(problem: Problem, listed: list[Config], table: LayerTable, summary: Summary) -> Space:
        """The space of the configurations ``listed`` and their summary, for ``problem``: each
        configuration once per recompute form (once in the mode the problem pins, if it does),
        bounded in that form."""
        configs: list[Config] = listed
        source = np.arange(len(listed))
        if isinstance(listed, ConfigList) and problem.fixed_mode is None:
            configs, source = listed.by_form()
        form = configs.form if isinstance(configs, ConfigList) else np.full(len(configs), PER_LAYER)
        lower_bound, memory_lb = np.empty(len(configs)), np.empty(len(configs))
        for f in np.unique(form).tolist():  # FIRST_FULL is bounded as any mix: it is one
            rows = np.flatnonzero(form == f)
            lb, mem = summary.bounds(problem.objective, problem.fixed_mode if f in (PER_LAYER, FIRST_FULL) else f)
            lower_bound[rows], memory_lb[rows] = lb[source[rows]], mem[source[rows]]
        return Space(problem, configs, table, lower_bound, memory_lb, summary, listed)

    def for_problem(self, problem: Problem) -> Space:
        """This space for ``problem``, which differs from its own at most in the objective, the
        recompute mode it pins and the plans it keeps (the same configurations and coefficient
        tables): its bounds without scoring again."""
        return Space.of(problem, self.listed, self.table, self.summary)

    def scored(self, rows: Sequence[int]) -> Scored:
        """The configurations ``rows`` with their coefficient tables (re-indexed in that order)."""
        configs = self.configs.subset(rows) if isinstance(self.configs, ConfigList) else [self.configs[i] for i in rows]
        return Scored(configs, self.table, _terms(self.problem, self.table, to_candidates(configs, self.table),
                                                  costing_rows(self.problem, configs)))

    def uniform(self, mode: int, pinned: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Every configuration listed with recompute ``mode`` on every block, on an even split (with
        ``pinned``, the split its plans must take where it has one: :func:`split_of`), by the
        evaluator: (objective value, inf where it does not fit; memory or host shortfall) ``[len(listed)]``."""
        value, short = np.full(len(self.listed), np.inf), np.zeros(len(self.listed))
        p = self.problem
        which = costing_rows(p, self.listed)
        for rows in _groups(self.listed, which):
            model, assumptions = p.costing(int(which[rows[0]]))
            splits = [split_of(self.listed, i, p) for i in rows] if pinned else None
            b = evaluate_batch(self.table, p.cluster, to_candidates(self.listed, self.table, mode, rows, splits),
                               model.training.recipe(), assumptions)
            objective = {"time": b.step_time, "comm": b.comm_total, "memory": b.peak_memory}[p.objective]
            value[rows] = np.where(b.fits, objective, np.inf)
            short[rows] = np.maximum(b.shortfall, b.host_shortfall)
        return value, short


def _groups(configs: list[Config], costing: np.ndarray) -> list[np.ndarray]:
    """Row indices by pipeline depth (so stage arrays are as deep as the group's pp) and costing
    (``costing[i]``, :meth:`Problem.costing_index`: one per numpy pass), in chunks of at most GROUP_ROWS
    configurations and GROUP_CELLS configuration-stages."""
    pp = configs.arrays.pp if isinstance(configs, ConfigList) else np.array([cf.pp for cf in configs])
    key = pp * (int(costing.max(initial=0)) + 1) + costing
    out: list[np.ndarray] = []
    for value in np.unique(key):
        rows = np.flatnonzero(key == value)
        size = max(1, min(GROUP_ROWS, GROUP_CELLS // int(pp[rows[0]])))
        out.extend(rows[k:k + size] for k in range(0, len(rows), size))
    return out


SMALL_GROUP = 512  # a group of fewer configurations shares its numpy pass with its costing's other small ones


def _passes(groups: list[np.ndarray], costing: np.ndarray, pp: np.ndarray) -> list[list[np.ndarray]]:
    """:func:`_groups` (by pipeline depth, then costing) in numpy passes: a group of SMALL_GROUP
    configurations or more alone, the smaller ones of each costing together (a pass costs ~5 ms
    besides its rows: DeepSeek-V3's recipes that only one framework runs have ~100
    configurations at each depth), within GROUP_ROWS and GROUP_CELLS at the pass's deepest pipeline
    (``pp``: each configuration's)."""
    passes: list[list[np.ndarray]] = []
    shared: dict[int, list[np.ndarray]] = {}  # the pass each costing's next small group joins
    for rows in groups:
        if len(rows) >= SMALL_GROUP:
            passes.append([rows])
            continue
        current = shared.get(int(costing[rows[0]]))
        n = len(rows) + sum(len(r) for r in current or [])
        if current is None or n > GROUP_ROWS or n * int(pp[rows[0]]) > GROUP_CELLS:  # (groups come by depth)
            current = shared[int(costing[rows[0]])] = []
            passes.append(current)
        current.append(rows)
    return passes


def _depth_part(cand: Candidates, terms: StageTerms, rows: slice, stages: int) -> tuple[Candidates, StageTerms]:
    """Rows ``rows`` of a pass's candidates and coefficient tables, on their first ``stages``
    stages (views): the tables these rows have scored alone, at their own pipeline depth."""
    def cut(x: Any) -> Any:
        if not isinstance(x, np.ndarray):
            return x
        return x[rows, :stages] if x.ndim > 1 else x[rows]

    return (dataclasses.replace(cand.take(rows), counts=cand.counts[rows, :stages]),  # type: ignore[arg-type]
            type(terms)(**{f.name: cut(getattr(terms, f.name)) for f in dataclasses.fields(terms)}))


def _terms(problem: Problem, table: LayerTable, cand: Candidates, which: np.ndarray | None = None) -> StageTerms:
    """The candidates' coefficient tables, each row under its costing ``which`` (:meth:`Problem.costing`; 0 for all
    when None)."""
    kinds = [0] if which is None else np.unique(which).tolist()
    parts = []
    for k in kinds:
        model, assumptions = problem.costing(int(k))
        rows = np.arange(len(cand.tp)) if len(kinds) == 1 else np.flatnonzero(which == k)
        parts.append((rows, stage_terms(table, problem.cluster, cand if len(kinds) == 1 else cand.take(rows),
                                        model.training.recipe(), assumptions)))
    return parts[0][1] if len(parts) == 1 else _merged(parts, len(cand.tp))


def _merged(parts: list[tuple[np.ndarray, StageTerms]], n: int) -> StageTerms:
    """Coefficient tables of disjoint row sets (the same stage depth) as one table of ``n`` rows."""
    first = parts[0][1]
    fields = {}
    for f in dataclasses.fields(first):
        values = [getattr(terms, f.name) for _, terms in parts]
        if not isinstance(values[0], np.ndarray):  # a scalar every costing shares
            if any(v != values[0] for v in values):
                raise ValueError(f"costings disagree on {f.name}, which the search reads as one number")
            fields[f.name] = values[0]
            continue
        out = np.empty((n, *values[0].shape[1:]), dtype=values[0].dtype)
        for (rows, _), v in zip(parts, values, strict=True):
            out[rows] = v
        fields[f.name] = out
    return type(first)(**fields)


def costing_rows(problem: Problem, configs: Sequence[Config],
                 rows: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Each configuration's (of ``rows``, or all) :meth:`Problem.costing_index` ``[C]``."""
    picked = np.arange(len(configs)) if rows is None else np.asarray(rows, dtype=np.int64)
    if isinstance(configs, ConfigList):
        return configs.costing[picked]
    return np.array([problem.costing_index(configs[i]) for i in picked], dtype=np.int64)


def score_space(problem: Problem, configs: list[Config], deadline: float = math.inf) -> Space:
    """Sound lower bounds of every configuration, scored group by group (:func:`_summaries`),
    for the recompute mode the problem pins (if any); the space keeps what the bounds of the
    other modes need (:class:`solvers.bounds.Summary`).  Past ``deadline`` (a
    ``time.perf_counter()`` value) the space holds the groups scored so far, and its
    configurations say :attr:`ConfigList.stopped`."""
    table = layer_table(problem.model)
    parts = []
    which = costing_rows(problem, configs)
    for rows, summary in _summaries(problem, table, configs, which):
        parts.append((rows, summary))
        if time.perf_counter() > deadline and isinstance(configs, ConfigList) and \
                sum(len(r) for r, _ in parts) < len(configs):
            configs, parts = _scored_part(configs, parts)
            break
    return Space.of(problem, configs, table, Summary.stack(parts, len(configs)))


def _summaries(problem: Problem, table: LayerTable, configs: list[Config],
               which: np.ndarray) -> Iterator[tuple[np.ndarray, Summary]]:
    """Each group's rows (:func:`_groups`) and summary, the small groups of a costing scored in
    one numpy pass (:func:`_passes`), each summarized on its own stages (as scored alone)."""
    pp = configs.arrays.pp if isinstance(configs, ConfigList) else np.array([cf.pp for cf in configs])
    for groups in _passes(_groups(configs, which), which, pp):
        rows = np.concatenate(groups)
        cand = to_candidates(configs, table, rows=rows)
        terms = _terms(problem, table, cand, which[rows])  # as deep as the pass's deepest pipeline
        start = 0
        for group in groups:
            yield group, summarize(table, *_depth_part(cand, terms, slice(start, start + len(group)),
                                                       int(cand.pp[start])))
            start += len(group)


def _scored_part(configs: ConfigList, parts: list[tuple[np.ndarray, Summary]]) -> tuple[ConfigList,
                                                                                       list[tuple[np.ndarray, Summary]]]:
    """The configurations of ``parts`` only (a stopped scoring), the parts' rows re-indexed into them."""
    rows = np.concatenate([r for r, _ in parts])
    kept = configs.subset(rows)
    kept.stopped = True
    starts = np.cumsum([0, *(len(r) for r, _ in parts)])
    return kept, [(np.arange(a, a + len(r)), part) for a, (r, part) in zip(starts, parts, strict=False)]


def plan_from(config: Config, table: LayerTable, split: list[int], modes: list[list[list[int]]]) -> Plan:
    """The Plan of a configuration, a split (blocks per stage) and recompute counts
    ``modes[stage][kind] = [none, selective, full]``: full recompute goes to the first blocks
    of a stage (Megatron's ``--recompute-method block``), then selective, then none."""
    if any(x < 0 for row in modes for kind in row for x in kind):
        raise SpecError("negative recompute count")
    recompute: list[str] = []
    start = 0
    for s, n in enumerate(split):
        left = [list(modes[s][k]) for k in range(len(table.kinds))]
        for i in range(start, start + n):
            k = table.sequence[i]
            r = 2 if left[k][2] else (1 if left[k][1] else 0)
            left[k][r] -= 1
            recompute.append(RECOMPUTE[r])
        start += n
    return config.to_plan(split, recompute)
