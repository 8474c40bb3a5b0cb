"""Length normalization: how a (B, T) per-token loss becomes one micro-batch loss, one registry entry each -- the
choices of ``GRPOConfig.length_normalization`` (verl's ``loss_agg_mode``, TRL's part of ``loss_type``).

An entry is ``reduce(per_token_loss, response_mask, normalize_constant, empty_rows) -> 0-d loss`` with the divisor the
trainer must hand it (:class:`Aggregation`, :func:`register_aggregation`); ``package.module:fn`` names a user's function
(divisor ``"none"``). :func:`compute_grpo_loss` is the course's dispatch and the trainer's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_ext.functional import check_choice, check_same_shape, masked_mean, masked_normalize
from trl_ext.registry import Registry

__all__ = [
    "EMPTY_ROWS",
    "Aggregation",
    "AGGREGATIONS",
    "register_aggregation",
    "upstream_loss_types",
    "compute_grpo_loss",
]

EMPTY_ROWS = ("raise", "zero", "drop")
"""What ``compute_grpo_loss`` does with a row that has no response token."""

DIVISORS = ("none", "max_completion_length", "batch_tokens")

ReduceFn = Callable[..., torch.Tensor]
"""``reduce(per_token_loss (B, T), response_mask (B, T), normalize_constant, empty_rows) -> 0-d loss``."""


@dataclass(frozen=True)
class Aggregation:
    """How a micro-batch's per-token loss becomes its scalar loss, and what it divides by: one entry of
    :data:`AGGREGATIONS`.

    Attributes:
        name: the ``length_normalization`` value.
        reduce: ``reduce(per_token_loss (B, T), response_mask (B, T), normalize_constant, empty_rows) -> 0-d loss``.
        divisor: what the trainer passes as ``normalize_constant``: ``"none"``, ``"max_completion_length"``, or
            ``"batch_tokens"`` (the step's response tokens as one micro-batch's average share on one process).
        upstream_loss_type: TRL's ``loss_type`` that reduces the same way, or None.
        formula: the reduction in one line, for help texts.
        source: where it comes from."""

    name: str
    reduce: ReduceFn
    divisor: Literal["none", "max_completion_length", "batch_tokens"] = "none"
    upstream_loss_type: str | None = None
    formula: str = ""
    source: str = ""


def _check_entry(name: str, entry: Aggregation) -> None:
    check_choice(f"{name}: divisor", entry.divisor, DIVISORS)


AGGREGATIONS: Registry[Aggregation] = Registry(
    "length normalization",
    "length_normalization",
    Aggregation,
    wraps="reduce",
    expects="a function (per_token_loss, response_mask, normalize_constant, empty_rows) -> loss or a "
    "trl_ext.objective.aggregations.Aggregation",
    check=_check_entry,
    unique={"upstream_loss_type": "TRL's loss_type"},
)
"""``length_normalization`` -> its :class:`Aggregation`, in registration order (a ``package.module:attr`` function
takes no divisor)."""


def register_aggregation(name: str, **declarations: Any) -> Callable[[ReduceFn], ReduceFn]:
    """Decorator: register the decorated ``reduce`` function under ``name`` with ``declarations`` (the fields of
    :class:`Aggregation`: ``divisor``, ``upstream_loss_type``, ``formula``, ``source``) and return it unchanged:
    ``AGGREGATIONS.register(name, **declarations)``.

    Raises:
        ValueError: the name, or the TRL ``loss_type`` it claims, is taken, or ``divisor`` is unknown.
    """
    return AGGREGATIONS.register(name, **declarations)


def upstream_loss_types() -> dict[str, str]:
    """TRL's ``loss_type`` -> the ``length_normalization`` that reduces the same way, from the registry now."""
    return {e.upstream_loss_type: name for name, e in AGGREGATIONS.items() if e.upstream_loss_type is not None}


# --------------------------------------------------------------------------------------------------------------
# The built-in aggregations  (CS336 A5 sections 7.2-7.3; Dr. GRPO; DAPO)
# --------------------------------------------------------------------------------------------------------------


def _response_tokens(response_mask: torch.Tensor) -> torch.Tensor:
    return response_mask.sum(dim=-1)


@register_aggregation(
    "masked_mean",
    upstream_loss_type="grpo",
    formula="each response's mean over its tokens, then the mean over responses (every response weighs the same)",
    source="CS336 A5 sections 7.2-7.3 (masked_mean); GRPO (Shao et al. 2024)",
)
def per_response_mean(per_token_loss, response_mask, normalize_constant, empty_rows):
    """Per response the mean over its tokens, then the mean over the responses (``empty_rows`` decides an empty
    one: raise, count as 0, or leave the mean)."""
    tokens = _response_tokens(response_mask)
    if empty_rows == "drop":
        per_example = masked_normalize(per_token_loss, response_mask, dim=-1) / tokens.clamp(min=1)
        return per_example.sum() / (tokens > 0).sum().clamp(min=1)
    empty = tokens == 0
    if empty.any() and empty_rows == "raise":
        raise ValueError(
            f"response_mask rows {empty.nonzero().flatten().tolist()} have no response token; masked_mean over "
            "them is undefined (expected at least one 1 per row)"
        )
    return masked_mean(per_token_loss, response_mask, dim=-1).masked_fill(empty, 0.0).mean()


@register_aggregation(
    "masked_normalize",
    divisor="max_completion_length",
    upstream_loss_type="dr_grpo",
    formula="each response's sum over its tokens / max_completion_length, then the mean over responses",
    source="CS336 A5 section 4.2 (masked_normalize); Dr. GRPO (Liu et al. 2025)",
)
def per_response_sum_over_constant(per_token_loss, response_mask, normalize_constant, empty_rows):
    """Per response the sum over its tokens / ``normalize_constant``, then the mean over the responses."""
    if normalize_constant is None:
        raise ValueError("length_normalization='masked_normalize' needs normalize_constant; got None")
    per_example = masked_normalize(per_token_loss, response_mask, dim=-1, normalize_constant=normalize_constant)
    if empty_rows == "drop":
        return per_example.sum() / (_response_tokens(response_mask) > 0).sum().clamp(min=1)
    return per_example.mean()


@register_aggregation(
    "masked_sum",
    upstream_loss_type="luspo",
    formula="each response's sum over its tokens, then the mean over responses (a sequence-level loss weighs its "
    "sequence by its length)",
    source="LUSPO (Length-Unbiased Sequence Policy Optimization, 2026): TRL 1.16's luspo reduction",
)
def per_response_sum(per_token_loss, response_mask, normalize_constant, empty_rows):
    """Per response the sum over its tokens (``masked_normalize`` with constant 1), then the mean over the responses
    (``empty_rows="drop"``: over those with a response token)."""
    per_example = masked_normalize(per_token_loss, response_mask, dim=-1)
    if empty_rows == "drop":
        return per_example.sum() / (_response_tokens(response_mask) > 0).sum().clamp(min=1)
    return per_example.mean()


def token_mean(per_token_loss, response_mask, normalize_constant, empty_rows):
    """The sum over every response token / ``normalize_constant`` (this batch's own token count when None; a count
    of 0 divides by 1)."""
    # A row without response tokens adds nothing to the sum nor to the count: every empty_rows choice agrees.
    tokens = response_mask.sum() if normalize_constant is None else normalize_constant
    tokens = torch.as_tensor(tokens, dtype=per_token_loss.dtype, device=per_token_loss.device)
    return masked_normalize(per_token_loss, response_mask) / tokens.clamp(min=1.0)


register_aggregation(
    "token_mean",
    divisor="batch_tokens",
    upstream_loss_type="dapo",
    formula="the sum over every response token of the whole batch (all processes and micro-batches of an "
    "optimizer step) / their count (every token weighs the same)",
    source="DAPO (Yu et al. 2025), section 3.3, token-level policy gradient loss",
)(token_mean)
register_aggregation(
    "local_token_mean",
    upstream_loss_type="bnpo",
    formula="the sum over the response tokens of each micro-batch of one process / their count",
    source="DAPO's token-level mean over the local micro-batch (TRL's bnpo)",
)(token_mean)


def compute_grpo_loss(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    length_normalization: str = "masked_mean",
    normalize_constant: float | torch.Tensor | None = None,
    empty_rows: Literal["raise", "zero", "drop"] = "raise",
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to one microbatch's scalar GRPO loss (an entry of :data:`AGGREGATIONS`).

    - ``masked_mean``: per example the mean over its response tokens, then the batch mean (the handout's default);
    - ``masked_normalize``: per example the sum divided by ``normalize_constant`` (Dr. GRPO), then the batch mean;
    - ``masked_sum``: per example the sum, then the batch mean (TRL's ``luspo``);
    - ``token_mean`` / ``local_token_mean``: the sum over every response token divided by ``normalize_constant`` (DAPO),
      or by this batch's own count when None (TRL's ``bnpo``); a count of 0 divides by 1, as TRL.

    Args:
        per_token_loss: (B, T).
        response_mask: (B, T), 1 on response tokens.
        length_normalization: a registered name or ``package.module:attr`` (default ``"masked_mean"``).
        normalize_constant: the divisor of ``masked_normalize`` (required) and the token means (optional).
        empty_rows: a row with no response token: ``"raise"`` (default; ValueError under ``masked_mean``), ``"zero"``
            (contributes 0, counts in the batch mean: TRL's ``grpo``) or ``"drop"`` (leaves the batch mean; 0 with
            finite gradients when no row is left; what ``trl_ext.GRPOTrainer`` uses). Token means ignore it.

    Returns:
        0-d tensor.

    Raises:
        ValueError: a shape mismatch, an unknown ``length_normalization`` or ``empty_rows``, a missing
            ``normalize_constant``, or (``masked_mean``, ``"raise"``) a row with no response token (named).

    Source: CS336 A5 handout, sections 7.2-7.3; Liu et al. 2025 (``masked_normalize``); Yu et al. 2025 (DAPO)."""
    check_same_shape("per_token_loss", per_token_loss, "response_mask", response_mask)
    entry = AGGREGATIONS.get(length_normalization)
    check_choice("empty_rows", empty_rows, EMPTY_ROWS)
    return entry.reduce(per_token_loss, response_mask, normalize_constant, empty_rows)
