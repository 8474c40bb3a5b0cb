"""trl_ext.functional against values worked out by hand (shown in comments) or by an independent formula."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_ext import functional
from trl_ext.objective import aggregations, losses


class CharTokenizer:
    """One token per character (id = ord), pad id 0: makes tokenization checkable by eye."""

    pad_token_id = 0

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


# ---------------------------------------------------------------- tokenize_prompt_and_output


# ---------------------------------------------------------------- entropy and log-probs


def test_entropy_with_minus_inf_logits_by_hand():
    logits = torch.tensor([[0.0, -math.inf, -math.inf], [0.0, 0.0, -math.inf]])
    h = functional.compute_entropy(logits)
    assert h[0].item() == 0.0
    assert h[1].item() == pytest.approx(math.log(2), abs=1e-6)
    assert not torch.isnan(h).any()


def test_entropy_matches_categorical_and_uniform():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(functional.compute_entropy(logits), expected, atol=1e-5, rtol=1e-5)
    assert functional.compute_entropy(torch.zeros(7)).item() == pytest.approx(math.log(7), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_entropy_finite_in_low_precision(dtype):
    logits = torch.tensor([[60000.0, 0.0, -60000.0, -math.inf], [0.0, 0.0, 0.0, 0.0]]).to(dtype)
    h = functional.compute_entropy(logits)
    assert h.dtype == dtype and torch.isfinite(h).all()
    assert h[0].item() == pytest.approx(0.0, abs=1e-3)
    assert h[1].float().item() == pytest.approx(math.log(4), abs=2e-2)


# ---------------------------------------------------------------- masked reductions


def test_length_normalization_example_by_hand():
    loss = torch.tensor([[2.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    # masked_mean per example: [2, 1] -> batch mean 1.5 ; masked_normalize by 4: [4/4, 4/4] -> 1.0
    assert aggregations.compute_grpo_loss(loss, mask, "masked_mean").item() == pytest.approx(1.5)
    assert aggregations.compute_grpo_loss(loss, mask, "masked_normalize", normalize_constant=4).item() == pytest.approx(
        1.0
    )
    # padding holding garbage never enters numerator or denominator
    garbage = loss.clone()
    garbage[0, 2:] = torch.tensor([math.nan, math.inf])
    assert aggregations.compute_grpo_loss(garbage, mask, "masked_mean").item() == pytest.approx(1.5)
    assert aggregations.compute_grpo_loss(
        garbage, mask, "masked_normalize", normalize_constant=4
    ).item() == pytest.approx(1.0)


def test_masked_mean_and_normalize_dims_and_empty_slices():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 0, 1], [0, 0, 0]])
    assert functional.masked_mean(x, m).item() == pytest.approx(2.0)  # (1 + 3) / 2
    per_row = functional.masked_mean(x, m, dim=1)
    assert per_row[0].item() == pytest.approx(2.0) and math.isnan(per_row[1].item())  # 0/0 for the empty row
    assert functional.masked_mean(x, m, dim=0).tolist()[0] == pytest.approx(1.0)
    assert functional.masked_normalize(x, m, dim=1, normalize_constant=2.0).tolist() == [2.0, 0.0]
    assert functional.masked_normalize(x, m).item() == pytest.approx(4.0)


def test_masked_functions_reject_shape_mismatch():
    with pytest.raises(ValueError, match="mask has shape"):
        functional.masked_mean(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask has shape"):
        functional.masked_normalize(torch.zeros(2, 3), torch.ones(3))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e3, 1e3), st.booleans(), st.floats(-1e3, 1e3)), min_size=1, max_size=20))
def test_masked_mean_ignores_masked_values(rows):
    values = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    mask = torch.tensor([r[1] for r in rows])
    other = torch.where(mask, values, torch.tensor([r[2] for r in rows], dtype=torch.float64))
    a, b = functional.masked_mean(values, mask), functional.masked_mean(other, mask)
    if mask.any():
        assert a.item() == pytest.approx(b.item())
        assert a.item() == pytest.approx(values[mask].mean().item())
    else:
        assert math.isnan(a.item()) and math.isnan(b.item())
    assert functional.masked_normalize(values, mask, normalize_constant=3.0).item() == pytest.approx(
        functional.masked_normalize(other, mask, normalize_constant=3.0).item()
    )


# ---------------------------------------------------------------- group-normalized rewards


def test_group_advantages_agree_with_torch_std():
    torch.manual_seed(1)
    r = torch.rand(12)
    grouped = r.view(3, 4).double()
    expected = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    torch.testing.assert_close(functional.compute_group_advantages(r, 4), expected.flatten().float())


def test_equal_rewards_give_exactly_zero_advantage():
    for value in (0.1, 1 / 3, 7.0, 0.0):
        adv = functional.compute_group_advantages(torch.full((6,), value), group_size=3)
        assert adv.tolist() == [0.0] * 6
    # advantage_eps=0 (>= 0 is allowed): an all-equal group, or one with a single valid reward, is 0, not 0/0 = NaN
    rewards = torch.tensor([1.0, 1.0, 0.0, 2.0, float("nan"), 5.0])
    adv = functional.compute_group_advantages(rewards, group_size=2, advantage_eps=0.0)
    assert adv.tolist() == pytest.approx([0.0, 0.0, -(0.5**0.5), 0.5**0.5, 0.0, 0.0], abs=1e-7)
    assert adv[[0, 1, 4, 5]].tolist() == [0.0] * 4


def test_nearly_equal_rewards_give_finite_advantages():
    # centred values +-5e-6, unbiased std sqrt(2 * 25e-12) = 7.07e-6 -> 5e-6 / (7.07e-6 + 1e-6) = 0.62
    adv = functional.compute_group_advantages(torch.tensor([1.0, 1.00001]), group_size=2, advantage_eps=1e-6)
    assert torch.isfinite(adv).all()
    assert adv.tolist() == pytest.approx([-0.62, 0.62], abs=0.005)


# Sums of reward functions that are equal in exact arithmetic but not in float32 (NVIDIA-NeMo/RL#4158): each case
# gives the weighted terms of 4 rows (one group), summed in float32 as the trainer sums them (terms.nansum(1)).
FLOAT_EQUAL_SUMS = {
    "two functions": ([[0.1, 0.6], [0.2, 0.5], [0.1, 0.6], [0.2, 0.5]], [1.0, 1.0]),
    "three functions": ([[0.1, 0.2, 0.4], [0.4, 0.1, 0.2], [0.3, 0.3, 0.1], [0.4, 0.1, 0.2]], [1.0, 1.0, 1.0]),
    "negative rewards": ([[-0.1, -0.6], [-0.2, -0.5], [-0.1, -0.6], [-0.2, -0.5]], [1.0, 1.0]),
    "weights 0.5 and 2": ([[0.0, 0.7], [0.4, 0.6], [0.0, 0.7], [0.4, 0.6]], [0.5, 2.0]),
    # 1000.1 - 1000 is 0.0999756 in float32, 2.4e-5 from 0.1: the error follows the terms, not the sum
    "large offset": ([[1000.1, -1000.0], [0.1, 0.0], [1000.1, -1000.0], [0.1, 0.0]], [1.0, 1.0]),
    "a NaN row": ([[0.1, 0.6], [float("nan")] * 2, [0.2, 0.5], [0.2, 0.5]], [1.0, 1.0]),
}


def weighted_terms(rows, weights, dtype=torch.float32):
    terms = torch.tensor(rows, dtype=dtype) * torch.tensor(weights, dtype=dtype)
    rewards = terms.nansum(dim=1)
    rewards[torch.isnan(terms).all(dim=1)] = torch.nan
    return rewards, terms


@pytest.mark.parametrize("case", FLOAT_EQUAL_SUMS)
@pytest.mark.parametrize("normalize_by_std", [True, False])
def test_rewards_equal_up_to_float_rounding_give_exactly_zero_advantages(case, normalize_by_std):
    rewards, terms = weighted_terms(*FLOAT_EQUAL_SUMS[case])
    valid = rewards[~torch.isnan(rewards)]
    assert valid.max() > valid.min(), "the float32 sums must differ, or this case tests nothing"
    # exact arithmetic: every valid row sums to the same value, so every advantage is 0 (and 0 for the NaN row)
    advantages = functional.compute_group_advantages(rewards, 4, 1e-6, normalize_by_std, reward_terms=terms)
    assert advantages.tolist() == [0.0] * 4
    assert functional.equal_reward_groups(rewards, 4, terms).tolist() == [True]
    if case != "large offset":  # terms of one sign: each reward is its own scale, the default covers them
        assert functional.compute_group_advantages(rewards, 4, 1e-6, normalize_by_std).tolist() == [0.0] * 4


def test_float_noise_was_a_signal_before_the_rule():
    """What the rule removes, worked by hand: two rows at 0.7 + 2^-24 and two at 0.7 - 2^-25 (one float32 ulp,
    5.96e-8, apart) centre to +-d/2 with unbiased std d/sqrt(3), so the plain formula gives
    (d/2) / (d/sqrt(3) + 1e-6) = 0.0288 -- the same size as NeMo-RL's reported +-0.0286."""
    rewards, _ = weighted_terms(*FLOAT_EQUAL_SUMS["two functions"])
    d = (rewards[0] - rewards[1]).double().item()
    assert d == pytest.approx(2**-24, rel=0.01)
    assert (d / 2) / (d / math.sqrt(3) + 1e-6) == pytest.approx(0.0288, abs=1e-4)


def test_a_cancelling_sum_needs_its_terms():
    """Without the terms, 1000.1 - 1000 against 0.1 (2.4e-5 apart, 2.4e-4 of the sum) is a real difference: only the
    terms' scale (2000.1) tells it is float32 rounding."""
    rewards, terms = weighted_terms(*FLOAT_EQUAL_SUMS["large offset"])
    assert functional.equal_reward_groups(rewards, 4).tolist() == [False]
    assert functional.equal_reward_groups(rewards, 4, terms).tolist() == [True]


@pytest.mark.parametrize("normalize_by_std", [True, False])
def test_a_truly_informative_group_keeps_its_advantages(normalize_by_std):
    # 0.7 and 0.7001 (1.0e-4 apart, 800 x the tolerance 2 * 2 * 1.19e-7 * 0.7001 = 1.7e-7 of two terms):
    # centred +-d/2; with the std, (d/2) / (d/sqrt(3) + 1e-6) = 0.866 * (1 - 1e-6 sqrt(3)/d) = 0.8510
    rows = [[0.1, 0.6], [0.2, 0.5001], [0.1, 0.6], [0.2, 0.5001]]
    rewards, terms = weighted_terms(rows, [1.0, 1.0])
    d = (rewards[1] - rewards[0]).double().item()
    expected = (d / 2) / (d / math.sqrt(3) + 1e-6) if normalize_by_std else d / 2
    advantages = functional.compute_group_advantages(rewards, 4, 1e-6, normalize_by_std, reward_terms=terms)
    assert advantages.tolist() == pytest.approx([-expected, expected, -expected, expected], rel=1e-5)
    assert abs(advantages[0].item()) > (0.85 if normalize_by_std else 4.9e-5)


def test_bf16_rewards_are_judged_at_bf16_rounding():
    """0.1 + 0.6 and 0.2 + 0.5 summed in bfloat16 are 0.703125 and 0.69921875, one bf16 ulp (2^-8) apart: equal up
    to bf16 rounding (tolerance 2 * 2 * 2^-7 * 0.703 = 0.022). The same values handed over as float32 are 2^-8
    apart, far beyond float32 rounding: they count as different (+-sqrt(3)/2 up to eps)."""
    bf16 = torch.bfloat16
    first = torch.tensor(0.1, dtype=bf16) + torch.tensor(0.6, dtype=bf16)
    second = torch.tensor(0.2, dtype=bf16) + torch.tensor(0.5, dtype=bf16)
    rewards = torch.stack([first, second, first, second])
    assert rewards.tolist() == [0.703125, 0.69921875, 0.703125, 0.69921875]
    assert functional.compute_group_advantages(rewards, 4).tolist() == [0.0] * 4
    as_float32 = functional.compute_group_advantages(rewards.float(), 4)
    assert as_float32.tolist() == pytest.approx([0.866, -0.866, 0.866, -0.866], abs=1e-3)


def test_reward_terms_must_have_a_row_per_reward():
    with pytest.raises(ValueError, match=r"reward_terms has shape \(3, 2\); expected \(4, K\)"):
        functional.compute_group_advantages(torch.zeros(4), 2, reward_terms=torch.zeros(3, 2))


@settings(max_examples=50, deadline=None)
@given(
    st.integers(2, 6).flatmap(
        lambda g: st.tuples(
            st.just(g), st.lists(st.floats(-100, 100), min_size=g, max_size=4 * g).map(lambda v: v[: len(v) // g * g])
        )
    ),
    st.booleans(),
)
def test_advantages_sum_to_zero_per_group(group_and_rewards, normalize_by_std):
    group_size, rewards = group_and_rewards
    adv = functional.compute_group_advantages(
        torch.tensor(rewards, dtype=torch.float64), group_size, 1e-6, normalize_by_std
    )
    sums = adv.double().view(-1, group_size).sum(dim=1)
    assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-3)
    assert torch.isfinite(adv).all()


# ---------------------------------------------------------------- policy-gradient losses


def test_naive_policy_gradient_loss_by_hand():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.25]])
    loss = functional.compute_naive_policy_gradient_loss(torch.tensor([[2.0], [-1.0]]), logp)
    assert loss.tolist() == [[2.0, 4.0], [-0.5, -0.25]]


def test_grpo_clip_loss_by_hand():
    # cliprange 0.2; (A, ratio): (1, 1.5) -> -min(1.5, 1.2) = -1.2 clipped; (-1, 1.5) -> -min(-1.5, -1.2) = 1.5
    # (1, 0.5) -> -min(0.5, 0.8) = -0.5 ; (-1, 0.5) -> -min(-0.5, -0.8) = 0.8 clipped
    old = torch.zeros(4, 1)
    logp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]]))
    adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]])
    loss, meta = functional.compute_grpo_clip_loss(adv, logp, old, cliprange=0.2)
    assert loss.flatten().tolist() == pytest.approx([-1.2, 1.5, -0.5, 0.8])
    assert meta["clipped"].flatten().tolist() == [True, False, False, True]


@pytest.mark.parametrize("same_object", [True, False])
def test_grpo_clip_never_differentiates_through_old_log_probs(same_object):
    logp = torch.tensor([[-1.0, -0.3, -2.0]], requires_grad=True)
    old = logp if same_object else logp.detach().clone().requires_grad_(True)
    loss, _ = functional.compute_grpo_clip_loss(torch.tensor([[2.0]]), logp, old, cliprange=0.2)
    loss.sum().backward()
    assert logp.grad.tolist() == [[-2.0, -2.0, -2.0]]  # ratio = 1, d(-ratio * A)/d logp = -A
    if not same_object:
        assert old.grad is None


@settings(max_examples=100, deadline=None)
@given(st.floats(-3, 3), st.floats(-5, 5).filter(lambda a: abs(a) > 1e-3), st.floats(0.0, 0.5))
def test_grpo_clip_loss_bounds(log_ratio, advantage, eps):
    loss, _ = functional.compute_grpo_clip_loss(
        torch.tensor([[advantage]], dtype=torch.float64),
        torch.tensor([[log_ratio]], dtype=torch.float64),
        torch.zeros(1, 1, dtype=torch.float64),
        eps,
    )
    ratio = math.exp(log_ratio)
    # the objective min(ratio A, clip(ratio) A) never exceeds the clipped ceiling (1 + eps) A for A > 0,
    # and for A < 0 the loss is at least (1 - eps) |A|
    if advantage > 0:
        assert loss.item() >= -(1 + eps) * advantage - 1e-9
    else:
        assert loss.item() >= (1 - eps) * abs(advantage) - 1e-9
    assert loss.item() <= -min(ratio * advantage, min(max(ratio, 1 - eps), 1 + eps) * advantage) + 1e-9


def test_policy_gradient_loss_dispatch_and_errors():
    logp = torch.tensor([[-1.0, -2.0]])
    a = torch.tensor([[3.0]])
    assert losses.compute_policy_gradient_loss(logp, "no_baseline", raw_rewards=a)[0].tolist() == [[3.0, 6.0]]
    assert losses.compute_policy_gradient_loss(logp, "reinforce_with_baseline", advantages=a)[0].tolist() == [
        [3.0, 6.0]
    ]
    with pytest.raises(ValueError, match="loss_type='ppo' is not supported"):
        losses.compute_policy_gradient_loss(logp, "ppo", advantages=a)
    with pytest.raises(ValueError, match="needs raw_rewards"):
        losses.compute_policy_gradient_loss(logp, "no_baseline", advantages=a)
    with pytest.raises(ValueError, match="needs old_log_probs, cliprange"):
        losses.compute_policy_gradient_loss(logp, "grpo_clip", advantages=a)
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 1\)"):
        losses.compute_policy_gradient_loss(logp, "reinforce_with_baseline", advantages=torch.ones(2, 1))
    with pytest.raises(ValueError, match="old_log_probs has shape"):
        functional.compute_grpo_clip_loss(a, logp, torch.zeros(1, 3), 0.2)


def test_token_mean_by_hand():
    # DAPO's token-level loss: every response token of the batch weighs the same
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    # tokens 1, 3, 6 -> sum 10 over 3 tokens (masked_mean would give ((1 + 3) / 2 + 6) / 2 = 4)
    for name in ("token_mean", "local_token_mean"):
        assert aggregations.compute_grpo_loss(loss, mask, name).item() == pytest.approx(10 / 3)
    # the count of a larger batch the mean is over (the trainer passes the whole batch's tokens)
    assert aggregations.compute_grpo_loss(loss, mask, "token_mean", normalize_constant=8).item() == pytest.approx(1.25)
    assert aggregations.compute_grpo_loss(
        loss, mask, "token_mean", normalize_constant=torch.tensor(8.0)
    ).item() == pytest.approx(1.25)
    # an empty row changes nothing, whatever empty_rows says: it adds no token to the sum or the count
    with_empty = torch.cat([loss, torch.tensor([[math.nan, 7.0, 7.0]])])
    empty_mask = torch.cat([mask, torch.tensor([[0, 0, 0]])])
    for empty_rows in aggregations.EMPTY_ROWS:
        assert aggregations.compute_grpo_loss(with_empty, empty_mask, "token_mean", empty_rows=empty_rows).item() == (
            pytest.approx(10 / 3)
        )
    # no token at all: 0 / max(0, 1) = 0 with a finite zero gradient, as TRL's clamp(min=1)
    logp = torch.ones(2, 3, requires_grad=True)
    out = aggregations.compute_grpo_loss(logp * 2, torch.zeros(2, 3), "token_mean")
    out.backward()
    assert out.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))


def test_token_mean_gradient_weighs_every_token_the_same():
    # d loss / d l_t = 1 / N for each of the N response tokens of the batch, whatever the row lengths
    per_token = torch.zeros(3, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    aggregations.compute_grpo_loss(per_token, mask, "token_mean").backward()
    assert torch.equal(per_token.grad, mask / 7)


# ---------------------------------------------------------------- train steps


# ---------------------------------------------------------------- KL and GAE


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    # d = ref - logp = -0.5: k1 = 0.5, k2 = 0.125, k3 = e^-0.5 + 0.5 - 1 = 0.10653
    assert functional.compute_kl(logp, ref, "k1").item() == pytest.approx(0.5)
    assert functional.compute_kl(logp, ref, "k2").item() == pytest.approx(0.125)
    assert functional.compute_kl(logp, ref).item() == pytest.approx(0.1065, abs=1e-4)
    with pytest.raises(ValueError, match="estimator='k4' is not supported"):
        functional.compute_kl(logp, ref, "k4")
    with pytest.raises(ValueError, match="ref_log_probs has shape"):
        functional.compute_kl(logp, torch.zeros(2))


def test_k3_is_an_unbiased_kl_estimate():
    # sample tokens from p, average k3 -> close to the exact KL(p || q)
    torch.manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    exact = (p * (p / q).log()).sum().item()
    tokens = torch.multinomial(p, 200_000, replacement=True)
    k3 = functional.compute_kl(p.log()[tokens], q.log()[tokens], "k3").mean().item()
    assert k3 == pytest.approx(exact, abs=0.01)


@settings(max_examples=200, deadline=None)
@given(st.floats(-30, 0), st.floats(-30, 0))
def test_k3_and_k2_never_negative(logp, ref):
    for estimator in ("k2", "k3"):
        assert functional.compute_kl(torch.tensor([logp]), torch.tensor([ref]), estimator).item() >= 0.0


def test_compute_grpo_loss_empty_rows_count_as_zero_when_allowed():
    # TRL's convention for rows masked out entirely (mask_truncated_completions): they add 0 but count in the mean
    loss = torch.tensor([[3.0, 1.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert aggregations.compute_grpo_loss(loss, mask, empty_rows="zero").item() == pytest.approx(1.0)  # (2 + 0) / 2


def test_compute_grpo_loss_empty_rows_is_one_named_option():
    loss = torch.tensor([[3.0, 1.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    with pytest.raises(ValueError, match=r"rows \[1\] have no response token"):  # the default, "raise"
        aggregations.compute_grpo_loss(loss, mask)
    assert aggregations.compute_grpo_loss(loss, mask, empty_rows="drop").item() == pytest.approx(
        2.0
    )  # row 0 alone: (3 + 1) / 2
    # masked_normalize is defined on an empty row under the default: sum 0 / 2, counted in the mean -> (4/2 + 0) / 2
    assert aggregations.compute_grpo_loss(loss, mask, "masked_normalize", 2).item() == pytest.approx(1.0)
    with pytest.raises(
        ValueError, match=r"empty_rows='keep' is not supported; expected one of 'raise', 'zero', 'drop'"
    ):
        aggregations.compute_grpo_loss(loss, mask, empty_rows="keep")


def test_adaptive_kl_coefficient_by_hand():
    # measured 0.12 vs target 0.1: error 0.2 (at the clip) -> beta * (1 + 0.2 * 100 / 1000) = 0.05 * 1.02
    assert functional.adaptive_kl_coefficient(0.05, 0.12, 0.1, 1000, n_steps=100) == pytest.approx(0.051)
    # measured 0.09: error -0.1 -> 0.05 * (1 - 0.1 * 10 / 1000) = 0.04995
    assert functional.adaptive_kl_coefficient(0.05, 0.09, 0.1, 1000, n_steps=10) == pytest.approx(0.04995)
    # far above target: the error is clipped at +0.2
    assert functional.adaptive_kl_coefficient(1.0, 100.0, 0.1, 10, n_steps=1) == pytest.approx(1.02)
    with pytest.raises(ValueError, match="kl_target=0"):
        functional.adaptive_kl_coefficient(0.05, 0.1, 0, 1000)


DESIGN_FUNCTIONAL_API = (  # the table "Public functional API (trl_ext.functional)" of the design notes
    "tokenize_prompt_and_output",
    "compute_entropy",
    "get_response_log_probs",
    "masked_mean",
    "masked_normalize",
    "compute_group_normalized_rewards",
    "compute_naive_policy_gradient_loss",
    "compute_grpo_clip_loss",
    "compute_policy_gradient_loss",
    "grpo_microbatch_train_step",
    "sft_microbatch_train_step",
    "compute_kl",
    "compute_gae",
)


@pytest.mark.parametrize("name", DESIGN_FUNCTIONAL_API)
def test_every_function_of_the_agreed_api_imports_from_trl_ext_functional(name):
    """A function may live in another room (the objective's dispatch and the course's helpers), but ``from
    trl_ext.functional import NAME`` keeps working and gives the same object as its room, not a copy."""
    import importlib

    value = getattr(importlib.import_module("trl_ext.functional"), name)
    home = importlib.import_module(value.__module__)
    assert callable(value) and getattr(home, name) is value
    assert name in dir(functional)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_function'"):
        functional.no_such_function  # noqa: B018
