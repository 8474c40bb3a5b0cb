"""Preference and safety losses of trl_ext.functional, against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trl_ext import functional


def softplus(x: float) -> float:
    """-log sigmoid(-x), by hand."""
    return math.log1p(math.exp(x))


# ----- Bradley-Terry -----


def test_bradley_terry_with_margins_hand_value():
    # diffs minus margins: (2 - 1 - 0.5, 1 - 1 - 0) = (0.5, 0); -log sigmoid(0.5) = 0.474077, -log sigmoid(0) = log 2
    loss = functional.bradley_terry_loss(torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.0]))
    assert loss.item() == pytest.approx((softplus(-0.5) + math.log(2)) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.5836, abs=1e-4)


def test_bradley_terry_without_margin_and_gradient():
    chosen = torch.tensor([2.0, 1.0], requires_grad=True)
    loss = functional.bradley_terry_loss(chosen, torch.tensor([1.0, 1.0]))
    assert loss.item() == pytest.approx((softplus(-1.0) + math.log(2)) / 2, abs=1e-6)  # 0.503204
    loss.backward()
    # d/d r_c of mean(-log sigmoid(d)) = -(1 - sigmoid(d)) / B
    expected = [-(1 - 1 / (1 + math.exp(-1.0))) / 2, -0.25]
    assert chosen.grad.tolist() == pytest.approx(expected, abs=1e-6)


def test_bradley_terry_column_vectors_give_the_same_value_not_a_b_by_b_matrix():
    chosen, rejected = torch.tensor([[2.0], [1.0]]), torch.tensor([[1.0], [1.0]])
    assert functional.bradley_terry_loss(chosen, rejected, torch.tensor([0.5, 0.0])).item() == pytest.approx(
        0.583612, abs=1e-6
    )
    assert functional.bradley_terry_loss(chosen, rejected, torch.tensor([[0.5], [0.0]])).item() == pytest.approx(
        0.583612, abs=1e-6
    )


@pytest.mark.parametrize(
    "chosen, rejected, margin",
    [
        (torch.tensor([2.0, 1.0]), torch.tensor([[1.0], [1.0]]), None),  # (B,) against (B, 1)
        (torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([[0.5], [0.0]])),  # (B, 1) margin
        (torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0, 1.0]), None),
        (torch.ones(2, 2), torch.ones(2, 2), None),  # a 2-label head
        (torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.5])),
    ],
)
def test_bradley_terry_rejects_shapes_that_would_broadcast(chosen, rejected, margin):
    with pytest.raises(ValueError, match="shape"):
        functional.bradley_terry_loss(chosen, rejected, margin)


# ----- DPO / cDPO -----


def h_equals_two():
    # h = (-3 - -4) - (-6 - -5) = 1 + 1 = 2
    return torch.tensor([-3.0]), torch.tensor([-6.0]), torch.tensor([-4.0]), torch.tensor([-5.0])


def test_dpo_hand_values():
    assert functional.dpo_loss(*h_equals_two(), beta=0.1).item() == pytest.approx(softplus(-0.2), abs=1e-6)
    assert functional.dpo_loss(*h_equals_two(), beta=0.1).item() == pytest.approx(0.5981, abs=1e-4)
    assert functional.dpo_loss(*h_equals_two(), beta=0.1, label_smoothing=0.1).item() == pytest.approx(0.6181, abs=1e-4)
    # eps = 0.5: 0.5 * softplus(-0.2) + 0.5 * softplus(0.2)
    half = functional.dpo_loss(*h_equals_two(), beta=0.1, label_smoothing=0.5).item()
    assert half == pytest.approx(0.5 * softplus(-0.2) + 0.5 * softplus(0.2), abs=1e-6)


def test_dpo_averages_over_pairs_and_ignores_reference_gradients():
    policy_chosen = torch.tensor([-3.0, -1.0], requires_grad=True)
    ref_chosen = torch.tensor([-4.0, -1.0], requires_grad=True)
    zeros = torch.zeros(2)
    loss = functional.dpo_loss(policy_chosen, zeros, ref_chosen, zeros, beta=1.0)  # h = (1, 0)
    assert loss.item() == pytest.approx((softplus(-1.0) + math.log(2)) / 2, abs=1e-6)
    loss.backward()
    assert ref_chosen.grad is None or torch.all(ref_chosen.grad == 0)
    assert policy_chosen.grad.tolist() == pytest.approx([-(1 - 1 / (1 + math.exp(-1))) / 2, -0.25], abs=1e-6)


def test_cdpo_gradient_vanishes_at_its_optimum():
    # minimum of (1-eps) softplus(-x) + eps softplus(x) is at x = beta h = log((1 - eps) / eps)
    beta, eps = 0.5, 0.1
    h = torch.tensor([math.log(9) / beta], requires_grad=True)
    zero = torch.zeros(1)
    functional.dpo_loss(h, zero, zero, zero, beta=beta, label_smoothing=eps).backward()
    assert h.grad.item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    "beta, eps, match",
    [(0.0, 0.0, "beta"), (-1.0, 0.0, "beta"), (0.1, 0.6, "label_smoothing"), (0.1, -0.1, "label_smoothing")],
)
def test_dpo_rejects_bad_hyperparameters(beta, eps, match):
    with pytest.raises(ValueError, match=match):
        functional.dpo_loss(*h_equals_two(), beta=beta, label_smoothing=eps)


def test_dpo_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shape"):
        functional.dpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2, 1), torch.zeros(2), beta=0.1)


# ----- per-instance DPO -----


# ----- unlikelihood -----


def test_unlikelihood_hand_values_and_mask():
    log_probs = torch.tensor([[math.log(0.5), math.log(0.9), float("nan")], [math.log(0.3), float("inf"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = functional.unlikelihood_loss(log_probs, mask)
    # row 0: (-log 0.5 - log 0.1) / 2; row 1 has no masked token: 0 (the NaN/inf there never enter)
    assert out.tolist() == pytest.approx([(math.log(2) + math.log(10)) / 2, 0.0], abs=1e-5)


def test_unlikelihood_stays_finite_as_p_goes_to_one():
    log_probs = torch.tensor([[0.0, -1e-12, -1e-30, -1e-3, -50.0]], requires_grad=True)
    per_token = [functional.unlikelihood_loss(log_probs, torch.eye(5)[i : i + 1]) for i in range(5)]
    values = torch.cat(per_token)
    assert torch.isfinite(values).all()
    cap = -math.log(1e-5)  # 1 - p clamped at 1e-5
    assert values[:3].tolist() == pytest.approx([cap, cap, cap], rel=1e-5)
    assert values[3].item() == pytest.approx(-math.log(-math.expm1(-1e-3)), rel=1e-5)  # 6.908255, no cancellation
    assert values[4].item() == pytest.approx(math.exp(-50.0), rel=1e-4)  # tiny p: -log(1 - p) ~ p, not rounded to 0
    values.sum().backward()
    grad = log_probs.grad[0]
    assert torch.isfinite(grad).all()
    assert grad[:3].tolist() == [0.0, 0.0, 0.0]  # clamped: no gradient, as in Welleck et al.'s clamp
    # d/dx -log(1 - e^x) = e^x / (1 - e^x) = 999.5 at x = -1e-3
    assert grad[3].item() == pytest.approx(math.exp(-1e-3) / -math.expm1(-1e-3), rel=1e-4)


def test_banned_token_unlikelihood_hand_value():
    probs = torch.tensor([0.5, 0.2, 0.2, 0.1])
    logits = torch.log(probs).repeat(1, 2, 1) + torch.tensor([[[0.0], [3.0]]])  # a shift per position changes nothing
    out = functional.banned_token_unlikelihood_loss(logits, [1, 2, 2], torch.tensor([[1, 1]]))
    assert out.tolist() == pytest.approx([-math.log(0.6)], abs=1e-6)  # mass 0.2 + 0.2 = 0.4
    masked = functional.banned_token_unlikelihood_loss(logits, [0], torch.tensor([[0, 1]]))
    assert masked.tolist() == pytest.approx([math.log(2)], abs=1e-6)


@pytest.mark.parametrize("ids, match", [([], "empty"), ([4], "outside"), ([-1], "outside")])
def test_banned_token_unlikelihood_rejects_bad_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        functional.banned_token_unlikelihood_loss(torch.zeros(1, 2, 4), ids, torch.ones(1, 2))
