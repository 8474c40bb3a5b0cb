"""Advantage estimators, one registry entry each: the choices of ``GRPOConfig.advantage_estimator``.

An estimator turns a generation batch's rewards (all processes) into one advantage per rollout, independently of the
loss (verl's ``register_adv_est``): ``fn(rewards_per_func (N, K), reward_weights (K,), group_size, config) -> (N,)``
(:class:`AdvantageEstimator`, :func:`register_advantage_estimator`); ``package.module:fn`` names a user's. Advantages
exactly 0 are what ``skip_zero_advantage_rows`` skips and ``dynamic_sampling`` drops.

Shapes: ``N`` = rollouts (all processes), ``K`` = reward functions, ``G`` = group size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trl_ext.functional import compute_group_advantages
from trl_ext.registry import Registry

__all__ = [
    "AdvantageEstimator",
    "ADVANTAGE_ESTIMATORS",
    "DEFAULT_ADVANTAGE_ESTIMATOR",
    "register_advantage_estimator",
    "weighted_rewards",
]

EstimatorFn = Callable[..., torch.Tensor]
"""``fn(rewards_per_func (N, K), reward_weights (K,), group_size, config) -> (N,) advantages``."""

DEFAULT_ADVANTAGE_ESTIMATOR = "group_normalized"
"""The estimator of a config that names none, for a loss that is not defined with one of its own."""


@dataclass(frozen=True)
class AdvantageEstimator:
    """One way to turn a batch's rewards into per-rollout advantages: one entry of :data:`ADVANTAGE_ESTIMATORS`.

    Attributes:
        name: the ``advantage_estimator`` value.
        fn: ``fn(rewards_per_func, reward_weights, group_size, config) -> advantages``: rewards (N, K) float, NaN where
            a function gave none; weights (K,); G divides N; ``config`` the ``GRPOConfig``. Returns (N,) float32 on any
            device.
        options: the config attributes it reads.
        spans_groups: an advantage depends on other groups' rewards (``dynamic_sampling`` refuses it).
        formula: the advantage in one line, for help texts.
        source: where it comes from."""

    name: str
    fn: EstimatorFn
    options: tuple[str, ...] = ()
    spans_groups: bool = False
    formula: str = ""
    source: str = ""


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator",
    "advantage_estimator",
    AdvantageEstimator,
    expects="a function (rewards_per_func, reward_weights, group_size, config) -> advantages or a "
    "trl_ext.objective.advantages.AdvantageEstimator",
)
"""``advantage_estimator`` -> its :class:`AdvantageEstimator`, in registration order."""


def register_advantage_estimator(name: str, **declarations: Any) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register the decorated estimator function under ``name`` with ``declarations`` (the fields of
    :class:`AdvantageEstimator`: ``options``, ``spans_groups``, ``formula``, ``source``) and return it unchanged:
    ``ADVANTAGE_ESTIMATORS.register(name, **declarations)``.

    Raises:
        ValueError: the name is taken or a declaration is not a field.
    """
    return ADVANTAGE_ESTIMATORS.register(name, **declarations)


def weighted_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rollout's weighted sum of its reward functions' rewards, and the weighted terms.

    A missing reward (NaN) is left out of its sum; a rollout no function scored gets NaN (TRL 1.16's rule).

    Args:
        rewards_per_func: (N, K).
        reward_weights: (K,).

    Returns:
        ``(rewards (N,), terms (N, K))``, terms = weight x reward (NaN where missing).

    Raises:
        ValueError: ``reward_weights`` not one weight per column."""
    if rewards_per_func.dim() != 2 or reward_weights.shape != (rewards_per_func.size(1),):
        raise ValueError(
            f"rewards_per_func has shape {tuple(rewards_per_func.shape)} and reward_weights "
            f"{tuple(reward_weights.shape)}; expected (N, K) and (K,)"
        )
    terms = rewards_per_func * reward_weights.to(rewards_per_func.device)
    rewards = terms.nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards, terms


# --------------------------------------------------------------------------------------------------------------
# The built-in estimators  (CS336 A5 section 7.2)
# --------------------------------------------------------------------------------------------------------------


@register_advantage_estimator(
    "group_normalized",
    options=("advantage_eps", "normalize_by_std"),
    formula="(r - group mean) / (group std + advantage_eps), or r - group mean with normalize_by_std=False",
    source="CS336 A5 section 7.2, equation 28; GRPO (Shao et al. 2024); Dr. GRPO (Liu et al. 2025)",
)
def group_normalized(rewards_per_func, reward_weights, group_size, config):
    """The course's group-normalized advantages of the weighted rewards
    (:func:`trl_ext.functional.compute_group_advantages`): a group of rewards equal up to float rounding gets
    exactly 0, an unscorable rollout 0; divided by the std only when ``config.normalize_by_std`` and G > 1."""
    rewards, terms = weighted_rewards(rewards_per_func, reward_weights)
    return compute_group_advantages(
        rewards,
        group_size,
        advantage_eps=config.advantage_eps,
        normalize_by_std=bool(config.normalize_by_std) and group_size > 1,
        reward_terms=terms,
    )


@register_advantage_estimator(
    "raw_rewards",
    formula="r, the reward itself (0 where unscorable): no baseline",
    source="CS336 A5 section 7.2, equation 27 (no_baseline)",
)
def raw_rewards(rewards_per_func, reward_weights, group_size, config):
    """The weighted reward itself, NaN (unscorable) as 0: what ``pg_loss_type="no_baseline"`` weighs by."""
    rewards, _ = weighted_rewards(rewards_per_func, reward_weights)
    return torch.nan_to_num(rewards, nan=0.0)


# --------------------------------------------------------------------------------------------------------------
# TRL's other estimators  (trl.GRPOTrainer._generate_and_score_completions, TRL 1.16)
# --------------------------------------------------------------------------------------------------------------


def _batch_std(values: torch.Tensor) -> torch.Tensor:
    """The unbiased std of the non-NaN values (0 for fewer than 2), float64: ``trl.trainer.utils.nanstd``'s."""
    valid = values[~torch.isnan(values)].to(torch.float64)
    return valid.std() if valid.numel() > 1 else torch.zeros((), dtype=torch.float64)


@register_advantage_estimator(
    "batch_std",
    options=("advantage_eps",),
    spans_groups=True,
    formula="(r - group mean) / (std of the whole batch's rewards + advantage_eps): TRL's scale_rewards='batch'",
    source="TRL 1.16 scale_rewards='batch', after PPO-Lite (Liu et al. 2025, 'Tricks or Traps?', section 4.1)",
)
def batch_std(rewards_per_func, reward_weights, group_size, config):
    """Group-mean baseline, scaled by the std of every reward of the batch (all processes, unbiased, unscorable
    rollouts left out) + ``config.advantage_eps``: TRL's ``scale_rewards="batch"`` (which hard-codes eps 1e-4). A
    group of rewards equal up to float rounding gets exactly 0, an unscorable rollout 0, as in ``group_normalized``."""
    rewards, terms = weighted_rewards(rewards_per_func, reward_weights)
    centred = compute_group_advantages(rewards, group_size, normalize_by_std=False, reward_terms=terms)
    return (centred.to(torch.float64) / (_batch_std(rewards) + config.advantage_eps)).to(torch.float32)


@register_advantage_estimator(
    "normalize_then_sum",
    options=("advantage_eps",),
    spans_groups=True,
    formula="each reward function's (r - group mean) / (group std + advantage_eps), weighted and summed, then "
    "(s - batch mean) / (batch std + advantage_eps): TRL's multi_objective_aggregation='normalize_then_sum'",
    source="GDPO (Liu et al. 2026, 'Group reward-Decoupled Normalization Policy Optimization'); TRL 1.16",
)
def normalize_then_sum(rewards_per_func, reward_weights, group_size, config):
    """GDPO: each reward function's rewards normalized within each group (unbiased std + ``config.advantage_eps``;
    a function that gave no reward adds nothing to its rollout's sum), weighted and summed, then the sums
    normalized over the whole batch (unscorable rollouts left out of the mean and std, their advantage 0): TRL's
    ``multi_objective_aggregation="normalize_then_sum"`` (which hard-codes eps 1e-4 in both). A group of one
    function's rewards equal up to float rounding gives exactly 0 for that function, and a batch of equal sums
    exactly 0, by ``group_normalized``'s rule; with one rollout per group (evaluation) each function gives 0."""
    weights = reward_weights.to(rewards_per_func.device)
    normalized = torch.stack(
        [
            compute_group_advantages(column, group_size, advantage_eps=config.advantage_eps)
            if group_size > 1
            else torch.zeros_like(column, dtype=torch.float32)
            for column in rewards_per_func.to(torch.float32).unbind(dim=1)
        ],
        dim=1,
    ).to(rewards_per_func.device)
    terms = normalized * weights
    sums = terms.sum(dim=1)
    sums[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    if sums.numel() < 2:  # one rollout: no batch std (TRL: 0), its advantage is 0
        return torch.zeros_like(sums, dtype=torch.float32)
    return compute_group_advantages(sums, sums.numel(), advantage_eps=config.advantage_eps, reward_terms=terms)
