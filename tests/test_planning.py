"""The planning formulas against the numbers of the papers they come from (autoplace/planning.py)."""

from __future__ import annotations

import math

import pytest

from autoplace.errors import SpecError
from autoplace.planning import (
    advise_batch,
    kaplan_critical_batch,
    kaplan_loss,
    noise_scale_simple,
    parse_amount,
    parse_counts,
    steps_examples,
    tokens_at_batch,
    training_cost,
)


def test_amounts_and_counts_parse() -> None:
    assert parse_amount("15T", source="--tokens") == 15e12
    assert parse_amount("300b", source="--tokens") == 300e9
    assert parse_amount("2.5e12", source="--tokens") == 2.5e12
    assert parse_counts("8..4096", source="--gpus") == [2**k for k in range(3, 13)]
    assert parse_counts("8..100", source="--gpus") == [8, 16, 32, 64]
    assert parse_counts("64,8,16", source="--gpus") == [8, 16, 64]
    assert parse_counts("24", source="--gpus") == [24]


@pytest.mark.parametrize("bad", ["15Q", "", "-3T", "0", "T", "1e999"])
def test_bad_amounts_name_the_flag(bad: str) -> None:
    with pytest.raises(SpecError, match="--tokens"):
        parse_amount(bad, source="--tokens")


@pytest.mark.parametrize("bad", ["8..x", "0..8", "16..8", "8,a", "..8"])
def test_bad_counts_name_the_flag(bad: str) -> None:
    with pytest.raises(SpecError, match="--gpus"):
        parse_counts(bad, source="--gpus")


def test_days_gpu_hours_and_cost() -> None:
    # 15T tokens at 1M tokens/s: 15e6 s = 173.6 days; on 1024 GPUs 4.27M GPU-hours; at $2.50 $10.7M
    c = training_cost(15e12, 1e6, 1024, 2.5)
    assert c.days == pytest.approx(15e6 / 86400)
    assert c.gpu_hours == pytest.approx(1024 * 15e6 / 3600)
    assert c.cost == pytest.approx(c.gpu_hours * 2.5)
    assert training_cost(1e9, 1e3, 8).cost is None
    with pytest.raises(SpecError):
        training_cost(1e9, 0.0, 8)


def test_mccandlish_tradeoff() -> None:
    """McCandlish et al. 2018 Sec. 2.3: (S/S_min - 1)(E/E_min - 1) = 1; at B = B_crit training takes
    twice the fewest steps and twice the fewest examples; far below it E -> E_min, far above S -> S_min."""
    for ratio in (0.01, 0.3, 1.0, 7.0, 100.0):
        s, e = steps_examples(ratio * 1e6, 1e6)
        assert (s - 1) * (e - 1) == pytest.approx(1.0)
    assert steps_examples(1e6, 1e6) == (2.0, 2.0)
    assert steps_examples(1e3, 1e6)[1] == pytest.approx(1.0, abs=1e-3)
    assert steps_examples(1e9, 1e6)[0] == pytest.approx(1.0, abs=1e-3)
    assert noise_scale_simple(trace_sigma=4.0, grad_norm_sq=0.5) == 8.0  # B_simple = tr(Sigma) / |G|^2


def test_kaplan_critical_batch_matches_the_paper() -> None:
    """Kaplan et al. 2020 eq. 1.4, B_crit(L) = 2e8 / L^(1/0.21) tokens: Fig. 10 draws the fit as
    2.1e8 tokens L^-4.8, within a few percent over the losses it shows (3 to 6 nats); B_crit is
    ~1M tokens at L = 3 (Fig. 10) and doubles for every 13% decrease in loss (Sec. 1.1)."""
    for loss in (3.0, 4.0, 5.0, 6.0):
        assert kaplan_critical_batch(loss) == pytest.approx(2.1e8 * loss**-4.8, rel=0.06)
    assert kaplan_critical_batch(3.0) == pytest.approx(1.07e6, rel=0.01)
    assert kaplan_critical_batch(0.87 * 3.0) / kaplan_critical_batch(3.0) == pytest.approx(2.0, rel=0.05)


def test_kaplan_loss_limits() -> None:
    """Kaplan et al. 2020 eq. 1.5: with unlimited data L -> (N_c/N)^alpha_N (eq. 1.1), with an
    unlimited model L -> (D_c/D)^alpha_D (eq. 1.2)."""
    assert kaplan_loss(1e9, 1e30) == pytest.approx((8.8e13 / 1e9) ** 0.076, rel=1e-6)
    assert kaplan_loss(1e30, 1e10) == pytest.approx((5.4e13 / 1e10) ** 0.095, rel=1e-6)
    assert kaplan_loss(1e9, 1e10) > kaplan_loss(1e9, 1e11) > kaplan_loss(1e10, 1e11)


def test_warning_on_the_papers_case() -> None:
    """At a target loss of 3 nats (Kaplan Fig. 10: B_crit ~ 1.07M tokens) a 2048 x 2048-token batch
    (4.2M tokens) is ~3.9 B_crit: it needs 4.9x the fewest tokens; the advised batch is the largest
    power of two of sequences under B_crit, 512 x 2048 = 1.05M tokens."""
    a = advise_batch(2048, 2048, non_embedding_params=85e6, target_loss=3.0)
    assert a.over and a.critical_tokens == pytest.approx(1.066e6, rel=0.01)
    assert a.tokens_factor == pytest.approx(1 + 2048 * 2048 / a.critical_tokens)
    assert a.advised_batch == 512
    assert "Kaplan et al. 2020 eq. 1.4" in a.lines()[1] and "target loss 3.000" in a.lines()[1]
    assert "warning" in a.lines()[0]
    ok = advise_batch(256, 2048, non_embedding_params=85e6, target_loss=3.0)
    assert not ok.over and "within" in ok.lines()[0]


def test_advice_sources() -> None:
    measured = advise_batch(1024, 4096, non_embedding_params=7e9, noise_scale_tokens=2e6)
    assert measured.critical_tokens == 2e6 and "McCandlish" in measured.source and measured.loss_nats is None
    assumed = advise_batch(1024, 4096, non_embedding_params=7e9)  # 20 tokens per parameter
    assert assumed.loss_nats == pytest.approx(kaplan_loss(7e9, 140e9))
    assert "Chinchilla" in assumed.assumption


def test_tokens_to_the_same_loss() -> None:
    """E scales as 1 + B/B_crit: half the batch at B = B_crit needs (1 + 0.5)/(1 + 1) of the tokens."""
    assert tokens_at_batch(10.0, 0.5, 1.0, 1.0) == pytest.approx(7.5)
    assert tokens_at_batch(10.0, 1.0, 1.0, 1.0) == 10.0
    assert math.isclose(tokens_at_batch(1.0, 4.0, 4.0, 3.0), 1.0)
