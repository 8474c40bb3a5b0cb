"""Policy-gradient losses in verl's shape, one registry entry each: the choices of ``GRPOConfig.pg_loss_type``.

A loss is ``fn(log_probs, old_log_probs, advantages, response_mask, config) -> (per_token_loss, metrics)`` (verl's
``PolicyLossFn`` without ``loss_agg_mode``: length normalization is :mod:`trl_ext.objective.aggregations`), registered
with :func:`register_policy_loss`; its declarations (:class:`PolicyLoss`) are all the trainer, config and speed paths
may assume. ``--pg_loss_type package.module:fn`` names a user's function or a :class:`PolicyLoss`.

Registered: the course's four losses, thin calls of ``trl_ext.functional``, then TRL 1.16's ``cispo``, ``sapo``,
``vespo``; :func:`compute_policy_gradient_loss` is the course's dispatch. Shapes: ``B`` = batch, ``T`` = completion
length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from trl_ext import functional
from trl_ext.functional import check_same_shape
from trl_ext.registry import Registry

__all__ = [
    "LossConfig",
    "PolicyLoss",
    "POLICY_LOSSES",
    "register_policy_loss",
    "policy_loss",
    "compute_policy_gradient_loss",
]

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``fn(log_probs, old_log_probs, advantages, response_mask, config) -> (per_token_loss, metrics)``."""


@dataclass(frozen=True)
class LossConfig:
    """The options a policy loss may read from its ``config``, with TRL 1.16's ``trl.GRPOConfig`` defaults (the course
    functions pass this; ``tests/test_losses.py`` checks the defaults match).

    Attributes:
        epsilon: the clip half-width (``cliprange`` in the course), default 0.2.
        epsilon_high: upper clip half-width (DAPO's clip-higher); None means ``epsilon``.
        delta: upper bound of the unclipped ratio (two-sided clipping), None for none.
        importance_sampling_level: ``"token"`` (a ratio per token) or ``"sequence"`` (GSPO: one per sequence).
        sapo_temperature_neg, sapo_temperature_pos: SAPO's gate temperatures for A < 0 and A > 0.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma weight shapes."""

    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


LOSS_OPTIONS = tuple(f.name for f in fields(LossConfig))
"""The config attributes a loss may declare in :attr:`PolicyLoss.options`."""


@dataclass(frozen=True)
class PolicyLoss:
    """A per-token policy-gradient loss and what a trainer may assume of it: one entry of :data:`POLICY_LOSSES`.

    Attributes:
        name: the ``pg_loss_type`` value (or the ``package.module:attr`` path).
        fn: ``fn(log_probs, old_log_probs, advantages, response_mask, config) -> (per_token_loss, metrics)``:
            ``log_probs`` (B, T) with gradient; ``old_log_probs`` (B, T) and ``advantages`` (B, 1) detached;
            ``response_mask`` (B, T); ``config`` has :class:`LossConfig`'s attributes. Returns the loss (B, T) or (B, 1)
            (sequence-level, broadcast by :func:`policy_loss`) and detached metrics, (B, T) or (B, 1): ``"clipped"``
            (bool; logged as TRL's ``clip_ratio/*``), ``"ratio"`` (``ratio/mean|min|max``), others under their own name.
        uses_old_log_probs: reads ``old_log_probs``, so it stays correct on stale samples; False: on-policy only.
        zero_advantage_zero_gradient: a rollout with advantage exactly 0 adds exactly 0 to loss and gradients (checked
            in ``tests/test_losses.py``); ``skip_zero_advantage_rows`` and ``dynamic_sampling`` need it.
        advantage_estimator: the estimator the loss is defined with (``"raw_rewards"`` for ``no_baseline``), or None.
        upstream_loss_type: TRL's ``loss_type`` with this per-token objective (``"cispo"``, ...), or None.
        length_normalization: the normalization the loss is defined with (``"token_mean"`` for cispo, vespo), or None.
        takes_sampling_ratio: takes vLLM's ``importance_sampling_ratio`` (B, T) itself; else :func:`policy_loss`
            multiplies the loss by it, as TRL 1.16 does.
        options: the :class:`LossConfig` fields the loss reads.
        formula: the per-token loss in one line, for help texts.
        source: where the formula comes from."""

    name: str
    fn: LossFn
    uses_old_log_probs: bool = False
    zero_advantage_zero_gradient: bool = False
    advantage_estimator: str | None = None
    upstream_loss_type: str | None = None
    length_normalization: str | None = None
    takes_sampling_ratio: bool = False
    options: tuple[str, ...] = ()
    formula: str = ""
    source: str = ""


def _check_entry(name: str, entry: PolicyLoss) -> None:
    unknown = [option for option in entry.options if option not in LOSS_OPTIONS]
    if unknown:
        raise ValueError(
            f"policy loss {name!r} reads options {unknown}, which trl_ext.objective.losses.LossConfig does not have "
            "(add them there with TRL's defaults)"
        )


POLICY_LOSSES: Registry[PolicyLoss] = Registry(
    "policy loss",
    "pg_loss_type",
    PolicyLoss,
    expects="a function (log_probs, old_log_probs, advantages, response_mask, config) -> (per_token_loss, metrics) "
    "or a trl_ext.objective.losses.PolicyLoss",
    check=_check_entry,
    unique={"upstream_loss_type": "TRL's loss_type"},
)
"""``pg_loss_type`` -> its :class:`PolicyLoss`, in registration order. A ``package.module:attr`` names a
:class:`PolicyLoss`, a function registered with its declarations, or a plain function of the loss signature (an
entry that declares nothing: on-policy only, every row's backward runs)."""


def register_policy_loss(name: str, **declarations: Any) -> Callable[[LossFn], LossFn]:
    """Decorator: ``POLICY_LOSSES.register(name, **declarations)`` (fields of :class:`PolicyLoss`); returns the function
    unchanged.

    Raises:
        ValueError: the name is taken, a declaration or option is unknown, or the TRL ``loss_type`` is claimed."""
    return POLICY_LOSSES.register(name, **declarations)


def policy_loss(
    loss: str | PolicyLoss,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any,
    importance_sampling_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run one policy loss on one batch, with its inputs and output checked: the call the trainer makes.

    Args:
        loss: a :data:`POLICY_LOSSES` name, a ``package.module:attr`` path, or an entry.
        log_probs: (B, T) log-probs of the sampled tokens under the policy being trained.
        old_log_probs: (B, T) log-probs under the policy that sampled them (detached here).
        advantages: (B, 1) or (B,) per-rollout advantages (detached here).
        response_mask: (B, T), 1 on the tokens that count.
        config: the options the loss reads (a ``GRPOConfig`` or a :class:`LossConfig`).
        importance_sampling_ratio: vLLM's per-token correction of the sampler's mismatch (TRL 1.16's
            ``inputs["importance_sampling_ratio"]``, (B, T) or (B, 1), detached), or None (default: none). A loss
            that declares ``takes_sampling_ratio`` gets it; any other loss is multiplied by it.

    Returns:
        ``(per_token_loss (B, T), metrics)``: a sequence-level (B, 1) loss broadcast over T.

    Raises:
        ValueError: an unknown loss; ``old_log_probs`` or ``response_mask`` not the shape of ``log_probs``;
            advantages not one per row; a loss returning another shape than (B, T) or (B, 1) (naming the loss).
    """
    entry = loss if isinstance(loss, PolicyLoss) else POLICY_LOSSES.get(loss)
    check_same_shape("log_probs", log_probs, "old_log_probs", old_log_probs)
    check_same_shape("log_probs", log_probs, "response_mask", response_mask)
    advantages = functional.per_example("advantages", advantages, log_probs).detach()
    arguments = (log_probs, old_log_probs.detach(), advantages, response_mask, config)
    if entry.takes_sampling_ratio:
        per_token_loss, metrics = entry.fn(*arguments, importance_sampling_ratio=importance_sampling_ratio)
    else:
        per_token_loss, metrics = entry.fn(*arguments)
    batch, length = log_probs.shape
    if per_token_loss.shape not in ((batch, length), (batch, 1)):
        raise ValueError(
            f"policy loss {entry.name!r} returned a loss of shape {tuple(per_token_loss.shape)}; expected ({batch}, "
            f"{length}) per token or ({batch}, 1) per sequence"
        )
    per_token_loss = per_token_loss if per_token_loss.shape[1] == length else per_token_loss.expand(batch, length)
    if importance_sampling_ratio is not None and not entry.takes_sampling_ratio:
        per_token_loss = per_token_loss * importance_sampling_ratio.detach()
    return per_token_loss, metrics


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token policy-gradient loss named by ``loss_type``, with the handout's arguments.

    - ``"no_baseline"``: ``-raw_rewards * log pi`` (needs ``raw_rewards``);
    - ``"reinforce_with_baseline"``: ``-advantages * log pi`` (needs ``advantages``);
    - ``"grpo_clip"``: ``compute_grpo_clip_loss`` (needs ``advantages``, ``old_log_probs``, ``cliprange``);
    - ``"grpo_no_clip"``: ``compute_grpo_no_clip_loss`` (needs ``advantages``, ``old_log_probs``; ``cliprange`` is
      ignored);
    - any other :data:`POLICY_LOSSES` entry: what it declares (``raw_rewards`` for a loss defined with the
      ``raw_rewards`` estimator, else ``advantages``; ``old_log_probs`` when it reads them; ``cliprange`` when it
      reads ``epsilon``), with every response token counted (no mask) and TRL's defaults for its other options.

    Args:
        policy_log_probs: (B, T) log-probs of the sampled tokens under the policy.
        loss_type: a registered name (or ``package.module:attr``).
        raw_rewards, advantages: (B, 1) or (B,) per-rollout weights; the entry says which one it reads.
        old_log_probs: (B, T) log-probs under the policy that sampled the rollouts.
        cliprange: the clip half-width epsilon.

    Returns:
        ``(loss (B, T), metadata)``; metadata is empty except for ``grpo_clip`` and ``grpo_no_clip`` (``ratio``,
        ``clipped``).

    Raises:
        ValueError: for an unknown ``loss_type`` or a missing argument that the loss type needs (named).

    Source: CS336 A5 handout, section 7.2 (``compute_policy_gradient_loss``).
    """
    entry = POLICY_LOSSES.get(loss_type, argument="loss_type")
    weights = "raw_rewards" if entry.advantage_estimator == "raw_rewards" else "advantages"
    given = {
        "raw_rewards": raw_rewards,
        "advantages": advantages,
        "old_log_probs": old_log_probs,
        "cliprange": cliprange,
    }
    required = (
        weights,
        *(("old_log_probs",) if entry.uses_old_log_probs else ()),
        *(("cliprange",) if "epsilon" in entry.options else ()),
    )
    missing = [name for name in required if given[name] is None]
    if missing:
        raise ValueError(f"loss_type={loss_type!r} needs {', '.join(missing)}; got None")
    values = functional.per_example(weights, given[weights], policy_log_probs)
    config = LossConfig() if cliprange is None else LossConfig(epsilon=cliprange)
    old = policy_log_probs.detach() if old_log_probs is None else old_log_probs
    return policy_loss(entry, policy_log_probs, old, values, torch.ones_like(policy_log_probs), config)


# --------------------------------------------------------------------------------------------------------------
# The course's losses  (CS336 A5 handout, sections 7.2-7.3 and 8)
# --------------------------------------------------------------------------------------------------------------


@register_policy_loss(
    "no_baseline",
    zero_advantage_zero_gradient=True,
    advantage_estimator="raw_rewards",
    formula="-r * log p with the raw reward r",
    source="CS336 A5 section 7.2, equation 27",
)
def no_baseline(log_probs, old_log_probs, advantages, response_mask, config):
    """-A * log p with A the raw reward (the ``raw_rewards`` estimator): REINFORCE without a baseline."""
    return functional.compute_naive_policy_gradient_loss(advantages, log_probs), {}


@register_policy_loss(
    "reinforce_with_baseline",
    zero_advantage_zero_gradient=True,
    formula="-A * log p with the group-normalized advantage A",
    source="CS336 A5 section 7.2, equation 27 with a baseline",
)
def reinforce_with_baseline(log_probs, old_log_probs, advantages, response_mask, config):
    """-A * log p (on-policy: the old log-probs are not read)."""
    return functional.compute_naive_policy_gradient_loss(advantages, log_probs), {}


@register_policy_loss(
    "grpo_clip",
    uses_old_log_probs=True,
    zero_advantage_zero_gradient=True,
    options=("epsilon", "epsilon_high", "delta", "importance_sampling_level"),
    formula="-min(ratio*A, clip(ratio, 1-epsilon, 1+epsilon_high)*A), ratio = pi/pi_old per token, or per sequence "
    "(importance_sampling_level='sequence', GSPO); delta bounds the unclipped ratio",
    source="CS336 A5 section 7.2, equation 29; PPO (Schulman et al. 2017); DAPO; INTELLECT-2; GSPO",
)
def grpo_clip(log_probs, old_log_probs, advantages, response_mask, config):
    """GRPO-Clip (:func:`trl_ext.functional.compute_grpo_clip_loss`) with ``config.epsilon`` as the clip half-width,
    ``config.epsilon_high`` the upper one (None: ``epsilon``), ``config.delta`` the bound of the unclipped ratio
    (None: none) and the ratio at ``config.importance_sampling_level``: TRL's loss of ``grpo``, ``bnpo``,
    ``dr_grpo``, ``dapo`` and ``luspo``. The defaults are the handout's loss."""
    return functional.compute_grpo_clip_loss(
        advantages,
        log_probs,
        old_log_probs,
        config.epsilon,
        cliprange_high=config.epsilon_high,
        delta=config.delta,
        importance_sampling_level=config.importance_sampling_level,
        response_mask=response_mask,
    )


@register_policy_loss(
    "grpo_no_clip",
    uses_old_log_probs=True,
    zero_advantage_zero_gradient=True,
    options=("importance_sampling_level",),
    formula="-ratio*A, the handout's clip ablation",
    source="CS336 A5 section 8 (clip ablation)",
)
def grpo_no_clip(log_probs, old_log_probs, advantages, response_mask, config):
    """-ratio * A (:func:`trl_ext.functional.compute_grpo_no_clip_loss`), the ratio at
    ``config.importance_sampling_level``."""
    return functional.compute_grpo_no_clip_loss(
        advantages,
        log_probs,
        old_log_probs,
        importance_sampling_level=config.importance_sampling_level,
        response_mask=response_mask,
    )


# --------------------------------------------------------------------------------------------------------------
# TRL's other per-token objectives  (trl.GRPOTrainer._compute_loss, TRL 1.16)
# --------------------------------------------------------------------------------------------------------------


def _ratio(log_probs, old_log_probs, response_mask, config):
    return functional.compute_importance_ratio(
        log_probs, old_log_probs, response_mask, config.importance_sampling_level
    )


@register_policy_loss(
    "cispo",
    uses_old_log_probs=True,
    zero_advantage_zero_gradient=True,
    upstream_loss_type="cispo",
    length_normalization="token_mean",
    options=("epsilon", "epsilon_high", "importance_sampling_level"),
    formula="-sg(min(ratio, epsilon_high)) * A * log p: the clipped ratio weighs REINFORCE, every token keeps a "
    "gradient",
    source="MiniMax-M1 (MiniMax 2025), CISPO, equation 4; ScaleRL (Khatri et al. 2025)",
)
def cispo(log_probs, old_log_probs, advantages, response_mask, config):
    """CISPO: ``-sg(min(ratio, eps_max)) * A * log p``, the ratio (per token, or per sequence with
    ``importance_sampling_level="sequence"``) clipped from above at ``config.epsilon_high`` itself (None:
    ``config.epsilon``), as TRL 1.16 reads it -- an absolute bound, not 1 + epsilon_high (TRL's help: ScaleRL's
    eps_max, recommended 5.0). Metric ``cispo_clip_ratio``: ratio > eps_max with A > 0 (TRL's)."""
    eps_max = config.epsilon if config.epsilon_high is None else config.epsilon_high
    ratio = _ratio(log_probs, old_log_probs, response_mask, config)
    weight = torch.clamp(ratio, max=eps_max).detach()
    clipped = (ratio > eps_max) & (advantages > 0)
    return -weight * advantages * log_probs, {"cispo_clip_ratio": clipped.float().detach(), "ratio": ratio.detach()}


@register_policy_loss(
    "sapo",
    uses_old_log_probs=True,
    zero_advantage_zero_gradient=True,
    upstream_loss_type="sapo",
    length_normalization="masked_mean",
    options=("sapo_temperature_pos", "sapo_temperature_neg", "importance_sampling_level"),
    formula="-(4/tau) * sigmoid(tau * (ratio - 1)) * A, tau = sapo_temperature_pos for A > 0, _neg otherwise: a "
    "soft gate in place of the clip",
    source="Soft Adaptive Policy Optimization (Gao et al. 2025), equation 5",
)
def sapo(log_probs, old_log_probs, advantages, response_mask, config):
    """SAPO: ``-(4 / tau) * sigmoid(tau * (ratio - 1)) * A``, whose gradient ``4 sigmoid'(tau (ratio - 1)) ratio A``
    is the plain ``ratio * A`` at ratio 1 and fades smoothly away from it; ``tau`` is ``config.sapo_temperature_pos``
    where A > 0 and ``config.sapo_temperature_neg`` elsewhere (TRL 1.16's)."""
    ratio = _ratio(log_probs, old_log_probs, response_mask, config)
    temperature = torch.where(advantages > 0, config.sapo_temperature_pos, config.sapo_temperature_neg)
    gate = torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature
    return -gate * advantages, {"ratio": ratio.detach()}


@register_policy_loss(
    "vespo",
    uses_old_log_probs=True,
    zero_advantage_zero_gradient=True,
    upstream_loss_type="vespo",
    length_normalization="token_mean",
    takes_sampling_ratio=True,
    options=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
    formula="-sg(phi(w)) * A * log p, phi(w) = exp(lambda) w^k exp(-lambda w) of the sequence ratio w (k, lambda "
    "by the sign of A)",
    source="VESPO (2026), the Gamma weighting of sequence-level importance weights; trl.GRPOTrainer.get_gamma_weights",
)
def vespo(log_probs, old_log_probs, advantages, response_mask, config, importance_sampling_ratio=None):
    """VESPO: ``-phi(w) * A * log p`` with ``phi`` the detached Gamma weight of the sequence's importance weight
    ``w = prod_t ratio_t`` times vLLM's per-token correction when given (``importance_sampling_ratio``: VESPO folds
    it into ``w`` instead of multiplying the loss). The weight is upstream's own static
    ``trl.GRPOTrainer.get_gamma_weights`` (TRL 1.16), called with ``config.vespo_*``; it is always sequence-level,
    whatever ``importance_sampling_level`` says. Metric ``vespo/phi_seq_mean`` (TRL's)."""
    from trl import GRPOTrainer  # upstream's math (a static method); loaded with the trainer, not at import

    phi = GRPOTrainer.get_gamma_weights(
        advantages=advantages,
        log_ratio_per_token=log_probs - old_log_probs,
        mask=response_mask,
        importance_sampling_ratio=importance_sampling_ratio,
        k_pos=config.vespo_k_pos,
        lambda_pos=config.vespo_lambda_pos,
        k_neg=config.vespo_k_neg,
        lambda_neg=config.vespo_lambda_neg,
    )
    ratio = torch.exp(log_probs - old_log_probs).detach()  # per token, for trl_ext's ratio/* metrics
    return -phi * advantages * log_probs, {"vespo/phi_seq_mean": phi.detach(), "ratio": ratio}
