"""What a training log says, as plain functions of TRL's ``trainer.state.log_history`` (a leaf: torch-free).

:func:`metric_curve` reads one metric's ``(step, value)`` points; :func:`entropy_collapsed` is the one rule for an
entropy collapse; :func:`observe_training` writes the sentences ``experiment.md`` opens its observations with (where
the reward rose fastest, entropy, completions at the length limit, gradient-norm spikes, KL). Used by
:mod:`trl_ext.report` (every recipe's record) and :mod:`trl_ext.compare` (arms' summaries, the ablations' notes).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def metric_curve(log_history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    """``[(step, value), ...]`` of every ``log_history`` entry that has ``key`` with a finite number."""
    return [
        (int(e["step"]), float(e[key]))
        for e in log_history
        if "step" in e and isinstance(e.get(key), (int, float)) and math.isfinite(e[key])
    ]


def _head_tail_means(values: Sequence[float], k: int) -> tuple[float, float]:
    k = max(1, min(k, len(values) // 2 or 1))
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def entropy_collapsed(first: float, last: float) -> bool:
    """Whether the policy's entropy collapsed between two measurements (nats/token): the last is below 0.1, or below
    a fifth of the first -- the policy became nearly deterministic, so exploration is mostly gone."""
    return last < 0.1 or last < first / 5


def _reward_note(reward: list[tuple[int, float]]) -> str:
    """First vs last reward, and where its running mean rose fastest (windows of about a fifth of the run)."""
    values = [v for _, v in reward]
    first, last = _head_tail_means(values, 3)
    window = max(1, len(values) // 5)
    best_gain, best_at = -math.inf, 0
    for i in range(len(values) - window):
        gain = statistics.fmean(values[i + 1 : i + 1 + window]) - statistics.fmean(
            values[max(0, i + 1 - window) : i + 1]
        )
        if gain > best_gain:
            best_gain, best_at = gain, i
    trend = "rose" if last > first else "fell" if last < first else "stayed flat"
    note = f"Train reward {trend} from {first:.3f} (first logged steps) to {last:.3f} (last)"
    if best_gain > 0:
        note += (
            "; it rose fastest around steps "
            f"{reward[best_at][0]}-{reward[min(best_at + window, len(reward) - 1)][0]}"
            f" (+{best_gain:.3f} between consecutive {window}-point means)"
        )
    return note + "."


def _length_note(log_history: Sequence[Mapping[str, Any]], max_completion_length: int | None) -> str | None:
    """Completions at the length limit (clipped share above 0.5, or mean length within 10% of it), else the last
    mean length and clipped share; None when neither is logged."""
    clipped = metric_curve(log_history, "completions/clipped_ratio")
    mean_length = metric_curve(log_history, "completions/mean_length")
    if clipped and clipped[-1][1] > 0.5:
        return (
            f"{clipped[-1][1]:.0%} of the last step's completions hit the length limit"
            + (f" ({max_completion_length} tokens)" if max_completion_length else "")
            + ": answers are being cut off; raise max_completion_length or reward brevity."
        )
    if mean_length and max_completion_length and mean_length[-1][1] >= 0.9 * max_completion_length:
        return f"Mean completion length {mean_length[-1][1]:.1f} is within 10% of the limit {max_completion_length}."
    if clipped or mean_length:
        tail = f"mean completion length {mean_length[-1][1]:.1f} tokens" if mean_length else ""
        share = f"{clipped[-1][1]:.0%} hit the length limit" if clipped else ""
        return "At the end: " + ", ".join(x for x in (tail, share) if x) + "."
    return None


def observe_training(
    log_history: Sequence[Mapping[str, Any]],
    max_completion_length: int | None = None,
    reward_key: str = "reward",
) -> list[str]:
    """Sentences about a training log (TRL's ``trainer.state.log_history``) that a reader would check first.

    - reward (``reward_key``): first vs last values (mean of up to 3 logged points each) and the window of about a
      fifth of the run where its running mean rose fastest;
    - ``loss`` when no reward was logged (SFT, reward models, DPO): first vs last;
    - ``entropy``: first vs last, and "collapsed" when the last value is below 0.1 nats/token or below a fifth of
      the first;
    - completion length: ``completions/clipped_ratio`` (share of completions that hit ``max_completion_length``)
      above 0.5 at the end, or the mean length within 10% of the limit;
    - ``grad_norm``: a spike when the largest value exceeds 5x the median;
    - ``kl``: its last value when logged.

    Returns:
        A list of sentences (empty for an empty log).
    """
    notes: list[str] = []
    reward = metric_curve(log_history, reward_key)
    if len(reward) >= 2:
        notes.append(_reward_note(reward))
    elif not reward:
        loss = metric_curve(log_history, "loss")
        if len(loss) >= 2:
            first, last = _head_tail_means([v for _, v in loss], 3)
            notes.append(f"Training loss went from {first:.4f} to {last:.4f} ({last - first:+.4f}).")
    entropy = metric_curve(log_history, "entropy")
    if len(entropy) >= 2:
        first, last = _head_tail_means([v for _, v in entropy], 3)
        collapsed = entropy_collapsed(first, last)
        notes.append(
            f"Entropy went from {first:.3f} to {last:.3f} nats/token"
            + (
                "; it collapsed (the policy became nearly deterministic, so exploration is mostly gone)."
                if collapsed
                else "; no collapse."
            )
        )
    length = _length_note(log_history, max_completion_length)
    if length:
        notes.append(length)
    grad = metric_curve(log_history, "grad_norm")
    if len(grad) >= 3:
        values = [v for _, v in grad]
        median = statistics.median(values)
        step, peak = max(grad, key=lambda sv: sv[1])
        if median > 0 and peak > 5 * median:
            notes.append(f"Gradient norm spiked to {peak:.3g} at step {step} (median {median:.3g}).")
        else:
            notes.append(f"Gradient norm stayed within 5x its median {median:.3g} (max {peak:.3g}).")
    kl = metric_curve(log_history, "kl")
    if kl:
        notes.append(f"KL to the reference ended at {kl[-1][1]:.4f} (step {kl[-1][0]}).")
    return notes
