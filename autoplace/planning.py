"""Questions bigger than one placement: how long and how much to train on a token budget, and
whether the global batch is past the critical batch size.

Every formula is a small pure function with its source:

- time and cost to a token budget: days = tokens / tokens_per_s / 86400, GPU-hours = GPUs x hours,
  cost = GPU-hours x price;
- the critical batch size: McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"
  (arXiv 1812.06162): the simple noise scale B_simple = tr(Sigma) / |G|^2 estimates B_noise ~ B_crit,
  and reaching a loss trades steps S against examples E as (S/S_min - 1)(E/E_min - 1) = 1, so at
  batch B: S = S_min (1 + B_crit/B), E = E_min (1 + B/B_crit);
- B_crit as a function of the loss: Kaplan et al. 2020, "Scaling Laws for Neural Language Models"
  (arXiv 2001.08361) eq. 1.4 / Sec. 5.1: B_crit(L) = B* / L^(1/alpha_B), B* ~ 2e8 tokens,
  alpha_B ~ 0.21 (the values of the paper's text; its Fig. 10 draws the fit as 2.1e8 tokens L^-4.8);
- the loss itself, when the user gives neither a target loss nor a measured noise scale:
  Kaplan et al. 2020 eq. 1.5, L(N, D) = [(N_c/N)^(alpha_N/alpha_D) + D_c/D]^alpha_D with
  N_c = 8.8e13 non-embedding parameters, D_c = 5.4e13 tokens, alpha_N = 0.076, alpha_D = 0.095
  (Table 1 / Sec. 1.2): the same paper, data and tokenizer as B_crit(L), so the two compose.

All of it is advice, not law: the fits are for WebText2 with GPT-2's tokenizer and Adam, and
B_crit grows during training (McCandlish Sec. 2.3), so the value at the final loss bounds the
batch from above.  The CLI prints the source and the assumption beside every number.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from autoplace.errors import SpecError
from autoplace.plan import MAX_COUNT

SECONDS_PER_DAY = 86_400.0

# Kaplan et al. 2020 eq. 1.4 (B_crit) and eq. 1.5 with Table 1 (L(N, D)); see the module docstring
KAPLAN_B_STAR_TOKENS = 2e8
KAPLAN_ALPHA_B = 0.21
KAPLAN_N_C = 8.8e13
KAPLAN_D_C = 5.4e13
KAPLAN_ALPHA_N = 0.076
KAPLAN_ALPHA_D = 0.095
CHINCHILLA_TOKENS_PER_PARAM = 20.0  # Hoffmann et al. 2022 (arXiv 2203.15556): compute-optimal D ~ 20 N

_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}
_AMOUNT = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*(?P<unit>[KMBGTP]?)\s*$", re.IGNORECASE)


# ---------------------------------------------------------------- parsing the flags


# The largest token amount (--tokens, --noise-scale): 1e18, some 10^5 times the largest corpora models
# train on (Llama 3's 15T); below it, days and cost stay finite for any price and throughput
MAX_TOKENS = 1e18


def parse_amount(text: str, *, source: str) -> float:
    """A token amount with an optional suffix: ``15T``, ``300B``, ``2.5e12``, ``1M``; from 1 to 1e18.

    Raises:
        SpecError: not a number from 1 to 1e18 with one of the suffixes K, M, B (or G), T, P.
    """
    match = _AMOUNT.match(text)
    value = float(match["num"]) * _SUFFIX[match["unit"].upper()] if match else 0.0
    if not match or not 1 <= value <= MAX_TOKENS:
        raise SpecError(f"expected an amount from 1 to 1e18 such as 15T, 300B or 2.5e12 (suffixes K, M, B, T, P), "
                        f"got {text!r}", source=source)
    return value


def parse_counts(text: str, *, source: str) -> list[int]:
    """GPU counts (or batch sizes): ``8..4096`` doubles from the lower bound up to the upper one
    (powers of two when the lower bound is one), ``8,16,64`` is an explicit list, ``64`` one value.

    Raises:
        SpecError: a bound or item that is not a positive integer, or lower > upper.
    """
    def integer(item: str) -> int:
        digits = item.strip()  # ASCII digits: int() refuses "²", which isdigit() takes
        if not (digits.isascii() and digits.isdigit()) or not 1 <= int(digits) < MAX_COUNT:
            raise SpecError(f"expected LOW..HIGH (e.g. 8..4096), a list (8,16,64) or one number; "
                            f"{digits!r} is not a whole number from 1 to 2**31 - 1", source=source)
        return int(digits)

    if ".." in text:
        low, _, high = text.partition("..")
        lo, hi = integer(low), integer(high)
        if lo > hi:
            raise SpecError(f"the lower bound must not exceed the upper one, but got {lo}..{hi}", source=source)
        return [lo * 2**k for k in range(int(math.log2(hi / lo)) + 1)]
    return sorted({integer(item) for item in text.split(",")})


# ---------------------------------------------------------------- time and cost to a token budget


@dataclass(frozen=True)
class TrainingCost:
    """Wall time and cost of training on ``tokens`` at ``tokens_per_s`` on ``gpus`` GPUs.

    ``cost`` is None without a price; ``gpus`` counts every GPU paid for (idle ones included).
    """

    tokens: float
    tokens_per_s: float
    gpus: int
    days: float
    gpu_hours: float
    price_per_gpu_hour: float | None
    cost: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """``15.0T tokens: 31.2 days, 1.92M GPU-hours, $4.79M at $2.50/GPU-hour``."""
        text = f"{short_amount(self.tokens)} tokens: {self.days:,.1f} days, {short_amount(self.gpu_hours)} GPU-hours"
        if self.cost is not None and self.price_per_gpu_hour is not None:
            text += f", ${short_amount(self.cost)} at ${self.price_per_gpu_hour:,.2f}/GPU-hour"
        return text


def training_cost(tokens: float, tokens_per_s: float, gpus: int, price_per_gpu_hour: float | None = None) -> TrainingCost:
    """days = tokens / tokens_per_s / 86400; GPU-hours = GPUs x hours; cost = GPU-hours x price.

    Raises:
        SpecError: a throughput that is not positive (no plan ran).
    """
    if not tokens_per_s > 0:
        raise SpecError(f"tokens_per_s must be positive to reach a token budget, but got {tokens_per_s}")
    seconds = tokens / tokens_per_s
    gpu_hours = gpus * seconds / 3600.0
    cost = None if price_per_gpu_hour is None else gpu_hours * price_per_gpu_hour
    return TrainingCost(tokens, tokens_per_s, gpus, seconds / SECONDS_PER_DAY, gpu_hours, price_per_gpu_hour, cost)


def short_amount(x: float) -> str:
    """A count in three significant figures and a K/M/B/T suffix: ``15T``, ``4.55M``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:,.0f}"


# ---------------------------------------------------------------- the critical batch size


def noise_scale_simple(trace_sigma: float, grad_norm_sq: float) -> float:
    """McCandlish et al. 2018 Sec. 2.2: B_simple = tr(Sigma) / |G|^2, the per-example gradient
    covariance's trace over the true gradient's squared norm (examples; B_noise when the Hessian
    is well conditioned, and B_crit ~ B_noise)."""
    return trace_sigma / grad_norm_sq


def steps_examples(batch: float, b_crit: float) -> tuple[float, float]:
    """(S/S_min, E/E_min) at ``batch``: McCandlish et al. 2018 Sec. 2.3, (S/S_min - 1)(E/E_min - 1) = 1
    with B_crit = E_min / S_min, so S/S_min = 1 + B_crit/B and E/E_min = 1 + B/B_crit (Kaplan et al.
    2020 eq. 5.4-5.5 use the same forms)."""
    return 1.0 + b_crit / batch, 1.0 + batch / b_crit


def kaplan_critical_batch(loss_nats: float) -> float:
    """Kaplan et al. 2020 eq. 1.4: B_crit(L) = B* / L^(1/alpha_B) tokens, B* ~ 2e8, alpha_B ~ 0.21."""
    return KAPLAN_B_STAR_TOKENS / loss_nats ** (1.0 / KAPLAN_ALPHA_B)


def kaplan_loss(non_embedding_params: float, tokens: float) -> float:
    """Kaplan et al. 2020 eq. 1.5: L(N, D) = [(N_c/N)^(alpha_N/alpha_D) + D_c/D]^alpha_D, in nats per
    token of WebText2 (N_c = 8.8e13, D_c = 5.4e13, alpha_N = 0.076, alpha_D = 0.095)."""
    ratio = KAPLAN_ALPHA_N / KAPLAN_ALPHA_D
    return float(((KAPLAN_N_C / non_embedding_params) ** ratio + KAPLAN_D_C / tokens) ** KAPLAN_ALPHA_D)


@dataclass(frozen=True)
class BatchAdvice:
    """The global batch against the critical batch size, with where B_crit came from.

    Attributes:
        batch_tokens: the global batch in tokens (sequences x sequence length).
        critical_tokens: B_crit in tokens.
        source: the paper and equation behind ``critical_tokens``.
        assumption: what was assumed to get there (the loss, or the measured noise scale).
        loss_nats: the loss B_crit was read at, when it came from B_crit(L).
        steps_factor, tokens_factor: S/S_min and E/E_min at this batch.
        advised_batch: the largest global batch (sequences) at or under B_crit: a power of two,
            or the user's list's, when ``candidates`` were given.
        applies: False for fine-tuning without a measured noise scale: no B_crit is estimated
            (``critical_tokens`` is then the batch itself, and nothing is advised).
    """

    batch_tokens: float
    critical_tokens: float
    source: str
    assumption: str
    loss_nats: float | None
    steps_factor: float
    tokens_factor: float
    advised_batch: int
    applies: bool = True

    @property
    def over(self) -> bool:
        return self.applies and self.batch_tokens > self.critical_tokens

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "over_critical": self.over}

    def lines(self) -> list[str]:
        """What the CLI prints: the verdict, the trade-off, the source and the assumption."""
        if not self.applies:
            return [f"batch: {self.source}", f"  {self.assumption}"]
        ratio = self.batch_tokens / self.critical_tokens
        verdict = ("[yellow]warning[/yellow]: the global batch is past the critical batch"
                   if self.over else "the global batch is within the critical batch")
        return [f"batch: {verdict}: {short_amount(self.batch_tokens)} tokens = {ratio:.2f} x B_crit "
                f"({short_amount(self.critical_tokens)} tokens); to reach the same loss it takes "
                f"{self.steps_factor:.2f} x the fewest steps and {self.tokens_factor:.2f} x the fewest tokens",
                f"  B_crit from {self.source}; {self.assumption}. Advice, not a law: B_crit grows as the loss falls"]


def advise_batch(global_batch: int, seq_len: int, *, non_embedding_params: float, tokens: float | None = None,
                 target_loss: float | None = None, noise_scale_tokens: float | None = None,
                 method: str = "full") -> BatchAdvice:
    """B_crit from a measured noise scale, else Kaplan's B_crit(L) at the target loss, else at
    Kaplan's L(N, D) for the token budget (20 tokens per parameter without one).

    Fine-tuning (``method`` lora or qlora) gets no B_crit without a measured noise scale: Kaplan's
    B_crit(L) and L(N, D) are fits to pre-training from scratch on WebText2, and a fine-tuning
    loss on another corpus, starting from a trained model, is not on those curves.
    """
    batch_tokens = float(global_batch * seq_len)
    if method != "full" and noise_scale_tokens is None:
        return BatchAdvice(batch_tokens, batch_tokens, _FINE_TUNING_SOURCE.format(method=method),
                           _FINE_TUNING_ASSUMPTION.format(batch=global_batch), None, 1.0, 1.0, global_batch,
                           applies=False)
    if noise_scale_tokens is not None:
        b_crit, loss = noise_scale_tokens, None
        source = "the measured gradient noise scale (McCandlish et al. 2018 Sec. 2.2: B_crit ~ B_noise)"
        assumption = f"--noise-scale {short_amount(noise_scale_tokens)} tokens, as given"
    else:
        source = "Kaplan et al. 2020 eq. 1.4, B_crit(L) = 2e8 tokens / L^(1/0.21)"
        if target_loss is not None:
            loss, assumption = target_loss, f"target loss {target_loss:.3f} nats, as given (--target-loss)"
        else:
            d = tokens if tokens is not None else CHINCHILLA_TOKENS_PER_PARAM * non_embedding_params
            loss = kaplan_loss(non_embedding_params, d)
            how = "--tokens" if tokens is not None else "20 tokens per parameter (Chinchilla), no --tokens given"
            assumption = (f"loss {loss:.3f} nats assumed from Kaplan eq. 1.5 L(N, D) with N = "
                          f"{short_amount(non_embedding_params)} non-embedding parameters and D = {short_amount(d)} tokens ({how}); "
                          f"WebText2 nats, so --target-loss or --noise-scale is better")
        b_crit = kaplan_critical_batch(loss)
    steps, examples = steps_examples(batch_tokens, b_crit)
    advised = 2 ** max(0, int(math.floor(math.log2(max(1.0, b_crit / seq_len)))))
    return BatchAdvice(batch_tokens, b_crit, source, assumption, loss, steps, examples, advised)


_FINE_TUNING_SOURCE = ("fine-tuning ({method}): no critical batch is estimated; Kaplan et al. 2020's B_crit(L) "
                       "and L(N, D) describe pre-training from scratch, not a trained model on a new corpus")
_FINE_TUNING_ASSUMPTION = ("the global batch of {batch:,} sequences is taken as given (the QLoRA recipes use 16 to 64 "
                           "sequences, Dettmers et al. 2023 App. B); a measured gradient noise scale (--noise-scale, "
                           "McCandlish et al. 2018) is compared against it")


def tokens_at_batch(tokens: float, batch_tokens: float, reference_batch_tokens: float, b_crit: float) -> float:
    """The tokens that reach the loss ``tokens`` reach at the reference batch, when training at
    ``batch_tokens`` instead: E scales as (1 + B/B_crit) (McCandlish et al. 2018 Sec. 2.3)."""
    return tokens * (1.0 + batch_tokens / b_crit) / (1.0 + reference_batch_tokens / b_crit)


# ---------------------------------------------------------------- what solve, evaluate and scale print


def non_embedding_params(table: Any) -> float:
    """Kaplan's N: the parameters outside the embedding and (untied) output matrices."""
    return float(table.params - table.embed.params_tp - (0 if table.tied else table.head.params_tp))


@dataclass(frozen=True)
class Outlook:
    """The token budget's time and cost, and the batch advice, for one plan (or none)."""

    cost: TrainingCost | None
    advice: BatchAdvice | None

    def to_dict(self) -> dict[str, Any]:
        return {"training_cost": self.cost.to_dict() if self.cost else None,
                "batch_advice": self.advice.to_dict() if self.advice else None}

    def lines(self) -> list[str]:
        out = [f"time and cost: {self.cost.summary()} on {self.cost.gpus} GPUs"] if self.cost else []
        return out + (self.advice.lines() if self.advice else [])


def outlook(model: Any, table: Any, gpus: int, tokens_per_s: float | None, *, tokens: float | None,
            price: float | None, target_loss: float | None, noise_scale: float | None,
            advise: bool) -> Outlook:
    """Time and cost to ``tokens`` (when given and a plan ran) and, when ``advise``, the batch advice."""
    cost = training_cost(tokens, tokens_per_s, gpus, price) if tokens and tokens_per_s else None
    advice = (advise_batch(model.training.global_batch, model.seq_len, non_embedding_params=non_embedding_params(table),
                           tokens=tokens, target_loss=target_loss, noise_scale_tokens=noise_scale,
                           method=model.training.method) if advise else None)
    return Outlook(cost, advice)
