"""The course math the trainers run, as pure torch functions on tensors: no model, no tokenizer, no backward, no I/O.

Each formula can be checked line by line against Stanford CS336 assignment 5 (spring 2025 handout and its safety/RLHF
supplement; "section" in the docstrings means the handout's). GRPOTrainer reaches the losses, advantages and length
normalizations through the registries of ``trl_ext.objective``; the reward, DPO and SFT trainers call
``bradley_terry_loss``, ``dpo_loss`` and the unlikelihood losses. The handout's helpers that take a model or a
tokenizer or call ``backward`` are in ``trl_ext.objective.course`` (re-exported by ``trl_ext.cs336``).

Shapes: ``B`` batch, ``T`` sequence length, ``V`` vocabulary, ``N`` rollouts. Masks hold 1 (True) on tokens that
count; a masked-out position never enters a numerator or a denominator, even when it holds NaN or inf.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = [
    "compute_entropy",
    "masked_mean",
    "masked_normalize",
    "equal_reward_groups",
    "compute_group_advantages",
    "compute_naive_policy_gradient_loss",
    "compute_importance_ratio",
    "compute_grpo_clip_loss",
    "compute_grpo_no_clip_loss",
    "compute_kl",
    "adaptive_kl_coefficient",
]

KL_ESTIMATORS = ("k1", "k2", "k3")


def check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Raise ValueError naming both tensors and their shapes unless ``a`` and ``b`` have the same shape."""
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}; expected equal shapes"
        )


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    """Raise ValueError naming ``name``, ``value`` and the ``choices`` unless ``value`` is one of them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {', '.join(map(repr, choices))}")


# --------------------------------------------------------------- Entropy  (handout section 4.2, "SFT helper methods")


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution, in nats, over the last dimension.

    H = -sum_v p_v log p_v with terms where p_v = 0 dropped (a -inf logit adds 0, not NaN); computed in float32,
    returned in the input dtype.

    Args:
        logits: (..., V), typically (B, T, V).

    Returns:
        (...), typically (B, T): entropy per position.

    Source: CS336 A5 handout, section 4.2 (``compute_entropy``).
    """
    logits32 = logits.float()
    log_p = torch.log_softmax(logits32, dim=-1)
    p = log_p.exp()
    plogp = torch.where(p > 0, p * log_p, torch.zeros_like(p))
    return (-plogp.sum(dim=-1)).to(logits.dtype)


# --------------------------------- Masked reductions  (handout sections 4.2 "masked_normalize" and 7.2 "masked_mean")


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``tensor`` over the elements where ``mask`` is 1; a fully masked slice gives NaN (0/0), like
    ``torch.mean`` of an empty tensor.

    Args:
        tensor: any shape.
        mask: same shape as ``tensor``; 1/True keeps an element.
        dim: dimension to average over; None averages over all elements (returns a 0-d tensor).

    Returns:
        the masked mean, with ``dim`` reduced (or a scalar when ``dim`` is None).

    Raises:
        ValueError: when ``tensor`` and ``mask`` differ in shape.

    Source: CS336 A5 handout, section 7.2 (``masked_mean``).
    """
    check_same_shape("tensor", tensor, "mask", mask)
    keep = mask.bool()
    total = torch.where(keep, tensor, torch.zeros_like(tensor))
    if dim is None:
        return total.sum() / keep.sum()
    return total.sum(dim=dim) / keep.sum(dim=dim)


def masked_normalize(
    tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None, normalize_constant: float = 1.0
) -> torch.Tensor:
    """Sum of ``tensor`` over the elements where ``mask`` is 1, divided by a constant (a fully masked slice gives 0).

    With ``normalize_constant`` = the maximum response length this is Dr. GRPO's length normalization (Liu et al.
    2025): every token weighs the same whatever its response's length.

    Args:
        tensor: any shape.
        mask: same shape as ``tensor``; 1/True keeps an element.
        dim: dimension to sum over; None sums over all elements.
        normalize_constant: the divisor (default 1.0); must be nonzero.

    Raises:
        ValueError: when shapes differ or ``normalize_constant`` is 0.

    Source: CS336 A5 handout, section 4.2 (``masked_normalize``).
    """
    check_same_shape("tensor", tensor, "mask", mask)
    if normalize_constant == 0:
        raise ValueError("normalize_constant=0; expected a nonzero divisor")
    total = torch.where(mask.bool(), tensor, torch.zeros_like(tensor))
    summed = total.sum() if dim is None else total.sum(dim=dim)
    return summed / normalize_constant


# ---------------------------------------------------- Group-normalized advantages  (handout section 7.2, equation 28)


EQUAL_REWARDS_MARGIN = 2.0
"""Safety factor of the all-equal rule of :func:`equal_reward_groups` over its first-order rounding bound."""


def _rounding_eps(dtype: torch.dtype) -> float:
    """Relative rounding of the rewards' arithmetic: float32's (TRL's), or a coarser float dtype's own."""
    eps32 = torch.finfo(torch.float32).eps
    return max(eps32, torch.finfo(dtype).eps) if dtype.is_floating_point else eps32


def equal_reward_groups(
    raw_rewards: torch.Tensor, group_size: int, reward_terms: torch.Tensor | None = None
) -> torch.Tensor:
    """Which groups' rewards are all equal up to the float rounding of how they were computed.

    Rewards equal in exact arithmetic can differ in float32 (0.1 + 0.6 against 0.2 + 0.5 differ by 5.96e-8), and
    ``advantage_eps`` 1e-6 does not hide a std of ~3e-8 (advantages +-0.029; NVIDIA-NeMo/RL#4158). A group of
    consecutive rows counts as all-equal when fewer than two of its rewards are valid (not NaN), or when

        max_g(r) - min_g(r) <= EQUAL_REWARDS_MARGIN * (K + 1) * eps * max_g(S_i),   S_i = sum_k |t_ik|

    over its valid rows, t_ik the K terms summed into reward i and eps float32's 1.19e-7 (or the terms' coarser
    dtype's: bf16 7.8e-3, fp16 9.8e-4). A computed sum of K terms is within (K + 1) * eps/2 * S_i of the exact one
    (first order; bounded by the terms' magnitudes, not the sum's: 1000.1 - 1000 is 2.4e-5 off in float32); two rows
    within twice that; the margin 2 covers second-order terms and rounding inside the reward functions. Without
    ``reward_terms`` each reward is one term (K = 1, S_i = |r_i|): pass the terms when they can cancel.

    Args:
        raw_rewards: (N,) rewards, NaN where unscorable; rows of a group consecutive.
        group_size: G >= 1; N must be a multiple of it.
        reward_terms: (N, K) the terms summed into each reward (NaN where a term is missing), or None (default:
            ``raw_rewards`` as one term).

    Returns:
        (N // G,) bool, True where the group's rewards count as all equal.

    Raises:
        ValueError: a non-1-D ``raw_rewards``, ``group_size`` < 1 or not dividing N, or ``reward_terms`` not of shape
            (N, K).

    Source: the float32 error bound of a sum (Higham, "Accuracy and Stability of Numerical Algorithms", 2002,
    section 4.2); the fault it prevents: NVIDIA-NeMo/RL#4158.
    """
    if raw_rewards.dim() != 1:
        raise ValueError(f"raw_rewards has shape {tuple(raw_rewards.shape)}; expected a 1-D tensor of N rewards")
    if group_size < 1 or raw_rewards.numel() % group_size != 0:
        raise ValueError(
            f"{raw_rewards.numel()} rollouts is not divisible by group_size={group_size}; "
            "expected consecutive groups of group_size rollouts per prompt"
        )
    terms = raw_rewards.unsqueeze(1) if reward_terms is None else reward_terms
    if terms.dim() != 2 or terms.size(0) != raw_rewards.numel():
        raise ValueError(
            f"reward_terms has shape {tuple(terms.shape)}; expected ({raw_rewards.numel()}, K): the K terms summed "
            "into each reward"
        )
    eps = _rounding_eps(terms.dtype)
    grouped = raw_rewards.detach().to(torch.float64).reshape(-1, group_size)
    valid = ~torch.isnan(grouped)
    scale = terms.detach().to(torch.float64).abs().nansum(dim=1).reshape(-1, group_size)
    spread = torch.where(valid, grouped, -math.inf).amax(dim=1) - torch.where(valid, grouped, math.inf).amin(dim=1)
    tolerance = EQUAL_REWARDS_MARGIN * (terms.size(1) + 1) * eps * torch.where(valid, scale, 0.0).amax(dim=1)
    return (valid.sum(dim=1) < 2) | (spread <= tolerance)


def compute_group_advantages(
    raw_rewards: torch.Tensor,
    group_size: int,
    advantage_eps: float = 1e-6,
    normalize_by_std: bool = True,
    reward_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-normalized advantages from rewards already computed; groups are consecutive blocks of ``group_size``.

        A_i = (r_i - mean_g(r)) / (std_g(r) + advantage_eps)   when normalize_by_std   (GRPO, Shao et al. 2024)
        A_i =  r_i - mean_g(r)                                  otherwise               (Dr. GRPO, Liu et al. 2025)

    std is unbiased (n - 1), as ``torch.std``. NaN rewards are left out of their group's mean and std and get
    advantage 0; a group all equal up to rounding (:func:`equal_reward_groups`) gets exactly 0. Computed in float64
    on values centred on the group's first valid reward, returned in float32.

    Args:
        raw_rewards: (N,) rewards, NaN where unscorable.
        group_size: rollouts per prompt; N must be a multiple of it; >= 2 when ``normalize_by_std``.
        advantage_eps: added to the std to avoid dividing by zero (default 1e-6, as in the handout).
        normalize_by_std: divide by the group std (default True).
        reward_terms: (N, K) the terms summed into each reward (weight x reward of each reward function), the
            rounding scale of the all-equal rule; None (default): each reward is its own.

    Returns:
        (N,) float32 advantages.

    Raises:
        ValueError: on a non-1-D input, a length not divisible by ``group_size``, ``group_size`` < 1, or
        ``group_size`` < 2 with ``normalize_by_std`` (a std needs two samples), or ``reward_terms`` not (N, K).

    Source: CS336 A5 handout, section 7.2 (``compute_group_normalized_rewards``); the all-equal rule: NeMo-RL #4158.
    """
    if raw_rewards.dim() != 1:
        raise ValueError(f"raw_rewards has shape {tuple(raw_rewards.shape)}; expected a 1-D tensor of N rewards")
    if group_size < 1:
        raise ValueError(f"group_size={group_size}; expected a positive integer")
    if normalize_by_std and group_size < 2:
        raise ValueError(
            f"group_size={group_size} with normalize_by_std=True; expected group_size >= 2 (the std of one sample is "
            "undefined)"
        )
    equal = equal_reward_groups(raw_rewards, group_size, reward_terms).unsqueeze(1)
    grouped = raw_rewards.detach().to(torch.float64).reshape(-1, group_size)
    valid = ~torch.isnan(grouped) & ~equal
    n_valid = valid.sum(dim=1, keepdim=True)
    first_valid = torch.gather(grouped, 1, valid.to(torch.int8).argmax(dim=1, keepdim=True))
    first_valid = torch.where(n_valid > 0, first_valid, torch.zeros_like(first_valid))
    shifted = torch.where(valid, grouped - first_valid, torch.zeros_like(grouped))
    mean_shift = shifted.sum(dim=1, keepdim=True) / n_valid.clamp(min=1)
    centred = torch.where(valid, shifted - mean_shift, torch.zeros_like(grouped))
    advantages = centred
    if normalize_by_std:
        variance = (centred**2).sum(dim=1, keepdim=True) / (n_valid - 1).clamp(min=1)
        # variance 0: every centred value is 0 (an all-equal group, or one valid reward), also with advantage_eps=0
        advantages = torch.where(variance > 0, centred / (variance.sqrt() + advantage_eps), torch.zeros_like(centred))
    return advantages.reshape(-1).to(torch.float32)


# ----------------------------------------------------------------- Policy-gradient losses  (handout sections 7.2-7.3)


def per_example(name: str, values: torch.Tensor, policy_log_probs: torch.Tensor) -> torch.Tensor:
    """Accept (B,) or (B, 1) per-example values and return (B, 1) to broadcast over T."""
    if values.dim() == 1:
        values = values.unsqueeze(-1)
    if values.dim() != 2 or values.shape[1] != 1 or values.shape[0] != policy_log_probs.shape[0]:
        raise ValueError(
            f"{name} has shape {tuple(values.shape)}; expected ({policy_log_probs.shape[0]}, 1) "
            f"to match policy_log_probs of shape {tuple(policy_log_probs.shape)}"
        )
    return values.to(policy_log_probs.dtype)


def compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor, policy_log_probs: torch.Tensor
) -> torch.Tensor:
    """Per-token REINFORCE loss  -A * log pi(o_t | q, o_<t).

    Args:
        raw_rewards_or_advantages: (B, 1) (or (B,)) reward or advantage per rollout, a constant (no gradient).
        policy_log_probs: (B, T) log-probs of the sampled tokens under the policy.

    Returns:
        (B, T) per-token loss (not yet masked or averaged).

    Raises:
        ValueError: when the batch dimensions do not match.

    Source: CS336 A5 handout, section 7.2 (``compute_naive_policy_gradient_loss``), equation 27.
    """
    advantages = per_example("raw_rewards_or_advantages", raw_rewards_or_advantages, policy_log_probs)
    return -advantages.detach() * policy_log_probs


IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def compute_importance_ratio(
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor | None = None,
    importance_sampling_level: Literal["token", "sequence"] = "token",
) -> torch.Tensor:
    """The importance ratio pi_theta / pi_theta_old of the sampled tokens (old log-probs detached).

    ``"token"``: ``exp(log pi_theta - log pi_theta_old)`` per token, (B, T); ``"sequence"``: exp of its mean over
    the response tokens, (B, 1) (GSPO; a row with no response token gets 1).

    Args:
        policy_log_probs: (B, T) log-probs under the policy being trained.
        old_log_probs: (B, T) log-probs under the policy that sampled the rollouts.
        response_mask: (B, T), 1 on the response tokens; needed for ``"sequence"``.
        importance_sampling_level: ``"token"`` (default) or ``"sequence"``.

    Returns:
        (B, T) or (B, 1) ratio, with gradient through ``policy_log_probs``.

    Raises:
        ValueError: on shape mismatches, an unknown level, or ``"sequence"`` without a ``response_mask``.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization", equation 7 (sequence level); trl.GRPOTrainer
    (TRL 1.16) ``_compute_loss``'s ``log_importance_weights``.
    """
    check_same_shape("policy_log_probs", policy_log_probs, "old_log_probs", old_log_probs)
    check_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    log_ratio = policy_log_probs - old_log_probs.detach()
    if importance_sampling_level == "token":
        return torch.exp(log_ratio)
    if response_mask is None:
        raise ValueError("importance_sampling_level='sequence' needs response_mask; got None")
    check_same_shape("policy_log_probs", policy_log_probs, "response_mask", response_mask)
    mask = response_mask.to(log_ratio.dtype)
    return torch.exp((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))


def compute_grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float,
    *,
    cliprange_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: Literal["token", "sequence"] = "token",
    response_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GRPO-Clip loss  -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A).

    ratio = exp(log pi_theta - log pi_theta_old), the old log-probs detached (also when they are the same tensor:
    on-policy, ratio = 1 and d loss / d log pi = -A). Keyword-only options are TRL's variants, off by default:
    ``cliprange_high`` clips to [1 - eps, 1 + eps_high] (DAPO); ``delta`` bounds the unclipped ratio,
    ``-min(min(ratio, delta) * A, clip(ratio) * A)`` (INTELLECT-2); ``"sequence"`` level: one ratio per sequence
    (GSPO, :func:`compute_importance_ratio`).

    Args:
        advantages: (B, 1) (or (B,)) advantage per rollout.
        policy_log_probs: (B, T) log-probs under the policy being trained.
        old_log_probs: (B, T) log-probs under the policy that sampled the rollouts.
        cliprange: epsilon, the clip half-width (e.g. 0.2); must be >= 0.
        cliprange_high: the upper half-width (default None: ``cliprange``); >= 0.
        delta: the upper bound of the unclipped ratio (default None: none); > 0.
        importance_sampling_level: ``"token"`` (default) or ``"sequence"``.
        response_mask: (B, T), 1 on response tokens; needed for ``"sequence"``.

    Returns:
        ``(loss, metadata)``: the loss (B, T), or (B, 1) at the sequence level; ``metadata["clipped"]`` bool of the
        ratio's shape, True where the clip bound took the gradient (ratio below 1 - eps with A < 0, or above
        1 + eps_high with A > 0, the ratio bounded by ``delta`` first: TRL's ``clip_ratio`` rule), and
        ``metadata["ratio"]`` the detached ratio.

    Raises:
        ValueError: on shape mismatches, a negative ``cliprange`` or ``cliprange_high``, ``delta`` <= 0, or an
            unknown level.

    Source: CS336 A5 handout, section 7.2 (``compute_grpo_clip_loss``), equation 29; PPO (Schulman et al. 2017);
    DAPO (Yu et al. 2025, section 3.1, clip-higher); INTELLECT-2 (Prime Intellect 2025, two-sided clipping); GSPO
    (Zheng et al. 2025).
    """
    check_same_shape("policy_log_probs", policy_log_probs, "old_log_probs", old_log_probs)
    if cliprange is None or cliprange < 0:
        raise ValueError(f"cliprange={cliprange!r}; expected a float >= 0")
    high = cliprange if cliprange_high is None else cliprange_high
    if high < 0:
        raise ValueError(f"cliprange_high={cliprange_high!r}; expected a float >= 0 (or None: cliprange)")
    if delta is not None and not delta > 0:
        raise ValueError(f"delta={delta!r}; expected a float > 0 (or None: no upper bound)")
    advantages = per_example("advantages", advantages, policy_log_probs).detach()
    ratio = compute_importance_ratio(policy_log_probs, old_log_probs, response_mask, importance_sampling_level)
    clipped = torch.clamp(ratio, 1.0 - cliprange, 1.0 + high) * advantages
    if delta is not None:
        ratio_bounded = torch.clamp(ratio, max=delta)
        loss = -torch.minimum(ratio_bounded * advantages, clipped)
        was_clipped = ((ratio_bounded < 1.0 - cliprange) & (advantages < 0)) | (
            (ratio_bounded > 1.0 + high) & (advantages > 0)
        )
        return loss, {"clipped": was_clipped, "ratio": ratio.detach()}
    unclipped = ratio * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, {"clipped": clipped < unclipped, "ratio": ratio.detach()}


def compute_grpo_no_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    *,
    importance_sampling_level: Literal["token", "sequence"] = "token",
    response_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GRPO-No-Clip loss  -ratio * A, ratio = exp(log pi_theta - log pi_theta_old) (no clipping).

    The ratio keeps the gradient unbiased for rollouts of an older policy; nothing bounds the step (the handout's
    clip ablation). Old log-probs detached; ``"sequence"`` level as in :func:`compute_importance_ratio`.

    Args:
        advantages: (B, 1) (or (B,)) advantage per rollout.
        policy_log_probs: (B, T) log-probs under the policy being trained.
        old_log_probs: (B, T) log-probs under the policy that sampled the rollouts.
        importance_sampling_level: ``"token"`` (default) or ``"sequence"``.
        response_mask: (B, T), 1 on response tokens; needed for ``"sequence"``.

    Returns:
        ``(loss, metadata)``: the loss (B, T), or (B, 1) at the sequence level, with ``metadata["ratio"]`` the
        detached ratio (for ratio statistics) and ``metadata["clipped"]`` all False (nothing is clipped; kept so
        clip-ratio metrics read 0 for this loss).

    Raises:
        ValueError: on shape mismatches or an unknown level.

    Source: CS336 A5 handout, section 8 (clip ablation, "GRPO-No-Clip"): -pi_theta / pi_theta_old * A per token.
    """
    check_same_shape("policy_log_probs", policy_log_probs, "old_log_probs", old_log_probs)
    advantages = per_example("advantages", advantages, policy_log_probs).detach()
    ratio = compute_importance_ratio(policy_log_probs, old_log_probs, response_mask, importance_sampling_level)
    loss = -ratio * advantages
    return loss, {"clipped": torch.zeros_like(ratio, dtype=torch.bool), "ratio": ratio.detach()}


# ---------------------------------------------------------------------- KL estimators and the adaptive KL coefficient


def compute_kl(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: Literal["k1", "k2", "k3"] = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With d = log pi_ref - log pi at the sampled token:

    - ``k1`` = -d = log pi - log pi_ref (unbiased, high variance, can be negative);
    - ``k2`` = d^2 / 2 (biased, low variance, never negative);
    - ``k3`` = exp(d) - d - 1 as ``expm1(d) - d`` (unbiased, low variance, never negative; the default, as in GRPO
      and TRL; the lecture's "log(Q/P) - 1" written correctly).

    Gradients flow into both arguments (detach ``ref_log_probs`` yourself).

    Args:
        log_probs: (B, T) log-probs under pi.
        ref_log_probs: (B, T) log-probs under the reference policy.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        (B, T) per-token estimates (mask and average them yourself).

    Raises:
        ValueError: on a shape mismatch or an unknown estimator.

    Source: J. Schulman, "Approximating KL Divergence" (2020).
    """
    check_same_shape("log_probs", log_probs, "ref_log_probs", ref_log_probs)
    check_choice("estimator", estimator, KL_ESTIMATORS)
    d = ref_log_probs - log_probs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d.pow(2) / 2
    return torch.expm1(d) - d


def adaptive_kl_coefficient(
    beta: float, measured_kl: float, kl_target: float, kl_horizon: float, n_steps: int = 1
) -> float:
    """One update of the adaptive KL coefficient (a proportional controller on the measured KL).

        error = clip(measured_kl / kl_target - 1, -0.2, 0.2);   beta <- beta * (1 + error * n_steps / kl_horizon)

    beta grows when the KL exceeds the target and shrinks below it, by at most a factor 1 +- 0.2 n_steps / horizon.

    Args:
        beta: current KL coefficient (> 0; a multiplicative controller cannot leave 0).
        measured_kl: KL(pi || pi_ref) measured since the last update (e.g. the masked mean of ``compute_kl``).
        kl_target: the KL the controller aims for (> 0).
        kl_horizon: how many samples the controller takes to correct an error (> 0; 10000 in Ziegler et al.).
        n_steps: samples seen since the last update (default 1).

    Returns:
        the new beta (float).

    Raises:
        ValueError: when ``beta``, ``kl_target`` or ``kl_horizon`` is not positive.

    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", section 2.2.
    """
    for name, value in (("beta", beta), ("kl_target", kl_target), ("kl_horizon", kl_horizon)):
        if not value > 0:
            raise ValueError(f"{name}={value!r}; expected a positive number")
    error = min(max(measured_kl / kl_target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / kl_horizon)


# ------------------------------------------------------------------- Preference and safety losses (course supplement)


def _pair_vectors(**named: torch.Tensor) -> int:
    """Check that per-pair tensors are all (B,) or all (B, 1) with one B; return B. Never lets (B,) meet (B, 1)."""
    shapes = {name: tuple(t.shape) for name, t in named.items()}
    first_name, first = next(iter(shapes.items()))
    if len(first) not in (1, 2) or (len(first) == 2 and first[1] != 1):
        raise ValueError(f"{first_name} has shape {first}; expected (B,) or (B, 1), one value per pair")
    for name, shape in shapes.items():
        if shape != first:
            raise ValueError(
                f"{name} has shape {shape} but {first_name} has shape {first}; expected identical (B,) or (B, 1) "
                "shapes (mixing (B,) with (B, 1) would broadcast to a B x B matrix)"
            )
    return first[0]


def bradley_terry_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Bradley-Terry pairwise loss of a reward model, averaged over pairs.

        loss = mean_i  -log sigmoid(r_chosen_i - r_rejected_i - margin_i)

    The negative log-likelihood of the Bradley-Terry model; ``margin`` (Llama 2, section 3.2.2; None = 0) asks the
    chosen reward to exceed the rejected one by that much. ``logsigmoid`` keeps it finite.

    Args:
        chosen_rewards: (B,) or (B, 1) scalar reward of each chosen response.
        rejected_rewards: same shape, reward of each rejected response.
        margin: optional, same shape as the rewards (or (B,) for (B, 1) rewards), one margin per pair.

    Returns:
        0-d tensor, the mean loss over the B pairs.

    Raises:
        ValueError: when the shapes are not one value per pair or differ ((B,) never meets (B, 1)), or B = 0.

    Source: Bradley & Terry (1952); Ouyang et al. 2022 (InstructGPT), equation 1; CS336 A5 supplement (reward
    modelling from preference pairs).
    """
    batch = _pair_vectors(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    if batch == 0:
        raise ValueError("chosen_rewards is empty; expected at least one preference pair")
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        margin = margin.to(device=diff.device, dtype=diff.dtype)
        if margin.shape != diff.shape and margin.dim() == 1 and margin.shape[0] == batch:
            margin = margin.reshape(diff.shape)  # (B,) margins for (B, 1) rewards
        _pair_vectors(chosen_rewards=chosen_rewards, margin=margin)
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """DPO loss, with optional conservative label smoothing (cDPO), averaged over pairs.

    With h = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x)) (summed response log-probs):

        loss = (1 - eps) * (-log sigmoid(beta * h)) + eps * (-log sigmoid(-beta * h))

    eps = 0 is DPO; eps > 0 is cDPO (each label flipped with probability eps; minimum at beta * h =
    log((1 - eps) / eps)). For beta = 0.1, h = 2: 0.5981 (eps = 0) and 0.6181 (eps = 0.1).

    Args:
        policy_chosen_logps: (B,) summed log-probs of the chosen responses under the policy (with gradient).
        policy_rejected_logps: (B,) same for the rejected responses.
        ref_chosen_logps: (B,) summed log-probs of the chosen responses under the reference (detached here).
        ref_rejected_logps: (B,) same for the rejected responses.
        beta: inverse temperature of the implicit reward (> 0), e.g. 0.1.
        label_smoothing: eps in [0, 0.5] (default 0.0).

    Returns:
        0-d tensor, the mean loss over the B pairs.

    Raises:
        ValueError: on mismatched or non-per-pair shapes, beta <= 0, or eps outside [0, 0.5].

    Source: Rafailov et al. 2023 (DPO), equation 7; E. Mitchell (2023), "A note on DPO with noisy preferences"
    (cDPO); CS336 A5 supplement (``compute_per_instance_dpo_loss``).
    """
    _pair_vectors(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    if not beta > 0:
        raise ValueError(f"beta={beta!r}; expected a positive float")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing={label_smoothing!r}; expected a float in [0, 0.5]")
    h = (policy_chosen_logps - ref_chosen_logps.detach()) - (policy_rejected_logps - ref_rejected_logps.detach())
    losses = -F.logsigmoid(beta * h)
    if label_smoothing > 0:
        losses = (1 - label_smoothing) * losses + label_smoothing * -F.logsigmoid(-beta * h)
    return losses.mean()


def _neg_log1mexp(log_p: torch.Tensor, min_one_minus_p: float) -> torch.Tensor:
    """-log(max(1 - p, min_one_minus_p)) from log p, without forming 1 - p when p is near 1 or near 0."""
    x = log_p.float().clamp(max=math.log1p(-min_one_minus_p))
    # log(1 - e^x): log(-expm1(x)) is accurate for x near 0, log1p(-exp(x)) for very negative x (Maechler 2012).
    log1mexp = torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
    return -log1mexp


def unlikelihood_loss(log_probs: torch.Tensor, mask: torch.Tensor, min_one_minus_p: float = 1e-5) -> torch.Tensor:
    """Token-level unlikelihood term of each sequence: mean over its masked tokens of -log(1 - p(token | prefix)).

    Computed stably from log p, with 1 - p clamped to at least ``min_one_minus_p``: at most -log(min_one_minus_p)
    (11.51 for 1e-5), finite with a finite gradient as p -> 1 (0 where the clamp is active, as in Welleck et al.'s
    code). A sequence with no masked token gives 0.

    Args:
        log_probs: (B, T) log p of each target token (<= 0).
        mask: (B, T), 1 on the tokens to penalize.
        min_one_minus_p: floor on 1 - p, in (0, 1) (default 1e-5).

    Returns:
        (B,) float32 per-sequence penalty.

    Raises:
        ValueError: on a shape mismatch or ``min_one_minus_p`` outside (0, 1).

    Source: Welleck et al. 2019, "Neural Text Generation with Unlikelihood Training", equation 4 (token-level
    unlikelihood); CS336 A5 supplement (safety penalty).
    """
    check_same_shape("log_probs", log_probs, "mask", mask)
    if not 0.0 < min_one_minus_p < 1.0:
        raise ValueError(f"min_one_minus_p={min_one_minus_p!r}; expected a float in (0, 1)")
    keep = mask.bool()
    per_token = torch.where(keep, _neg_log1mexp(torch.where(keep, log_probs, -1.0), min_one_minus_p), 0.0)
    counts = keep.sum(dim=-1)
    return per_token.sum(dim=-1) / counts.clamp(min=1)


def banned_token_unlikelihood_loss(
    logits: torch.Tensor,
    banned_token_ids: Sequence[int] | torch.Tensor,
    mask: torch.Tensor,
    min_one_minus_p: float = 1e-5,
) -> torch.Tensor:
    """Unlikelihood of a banned token set: per sequence, mean over masked positions of -log(1 - sum_b p(b)).

    The banned mass is formed in log space, exp(logsumexp(z_banned) - logsumexp(z)), then clamped as in
    :func:`unlikelihood_loss`. A sequence with no masked position gives 0.

    Args:
        logits: (B, T, V) next-token logits.
        banned_token_ids: the banned token ids (at least one, each in [0, V)).
        mask: (B, T), 1 at the positions to penalize (e.g. positions that predict a response token).
        min_one_minus_p: floor on 1 - mass, in (0, 1) (default 1e-5).

    Returns:
        (B,) float32 per-sequence penalty.

    Raises:
        ValueError: when ``banned_token_ids`` is empty or out of range, or ``mask`` is not ``logits.shape[:2]``.

    Source: Welleck et al. 2019 (unlikelihood over a set of negative candidates, equation 4).
    """
    ids = torch.as_tensor(banned_token_ids, dtype=torch.long, device=logits.device).flatten().unique()
    if ids.numel() == 0:
        raise ValueError("banned_token_ids is empty; expected at least one token id")
    vocab = logits.shape[-1]
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"banned_token_ids {ids.tolist()} fall outside the vocabulary [0, {vocab})")
    if logits.dim() != 3 or tuple(mask.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} and logits {tuple(logits.shape)}; expected (B, T) and (B, T, V)"
        )
    logits32 = logits.float()
    log_mass = torch.logsumexp(logits32[..., ids], dim=-1) - torch.logsumexp(logits32, dim=-1)
    return unlikelihood_loss(log_mass, mask, min_one_minus_p)


__all__ += [
    "bradley_terry_loss",
    "dpo_loss",
    "unlikelihood_loss",
    "banned_token_unlikelihood_loss",
]

ELSEWHERE = {
    "compute_policy_gradient_loss": "trl_ext.objective.losses",
    "compute_grpo_loss": "trl_ext.objective.aggregations",
    **{
        name: "trl_ext.objective.course"
        for name in (
            "tokenize_prompt_and_output",
            "get_response_log_probs",
            "compute_group_normalized_rewards",
            "grpo_microbatch_train_step",
            "sft_microbatch_train_step",
            "per_instance_dpo_loss",
            "compute_gae",
        )
    },
}
"""Names of the course's functional API (shared/design.md) whose function lives in the objective room: the dispatch
functions go through its registries, the course's helpers take a model, a tokenizer or call ``backward``. They are
served from here by name on first use (``from trl_ext.functional import compute_policy_gradient_loss``), the same
function object as in their room."""


def __getattr__(name: str) -> Any:
    if name in ELSEWHERE:
        import importlib

        return getattr(importlib.import_module(ELSEWHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *ELSEWHERE])
