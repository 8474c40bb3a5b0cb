"""The course-only helpers of CS336 assignment 5 (spring 2025 handout and supplement): what the handout asks students
to write that no trainer runs.

They take models or tokenizers or call ``backward`` themselves (tokenization with a response mask, response
log-probs, the microbatch train steps, per-instance DPO, GAE), built on the formulas of ``trl_ext.functional``;
``trl_ext.cs336`` re-exports them and wraps them as the ``run_*`` adapters.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trl_ext.functional import (
    check_same_shape,
    compute_entropy,
    compute_group_advantages,
    dpo_loss,
    masked_normalize,
)
from trl_ext.objective.aggregations import compute_grpo_loss
from trl_ext.objective.losses import compute_policy_gradient_loss

__all__ = [
    "tokenize_prompt_and_output",
    "get_response_log_probs",
    "mean_response_entropy",
    "compute_group_normalized_rewards",
    "grpo_microbatch_train_step",
    "sft_microbatch_train_step",
    "per_instance_dpo_loss",
    "compute_gae",
]


def tokenize_prompt_and_output(
    prompt_strs: Sequence[str], output_strs: Sequence[str], tokenizer: Any
) -> dict[str, torch.Tensor]:
    """Tokenize prompts and outputs separately, concatenate, pad, and build the response mask.

    Tokenized with ``add_special_tokens=False`` (render BOS or chat markup into the prompt yourself), so no token
    straddles the boundary; right-padded with ``tokenizer.pad_token_id`` to the longest length ``L``.

    Args:
        prompt_strs: B prompt strings.
        output_strs: B output (response) strings, aligned with ``prompt_strs``.
        tokenizer: a Hugging Face tokenizer with a pad token.

    Returns:
        dict with three (B, L-1) tensors:
        ``input_ids`` (long): the concatenation without its last token;
        ``labels`` (long): the concatenation without its first token (the next-token targets);
        ``response_mask`` (bool): True where the label is an output token, False on prompt and padding.

    Raises:
        ValueError: when the two lists differ in length, are empty, or the tokenizer has no pad token.

    Source: CS336 A5 handout, section 4.2 (``tokenize_prompt_and_output``).
    """
    if len(prompt_strs) != len(output_strs):
        raise ValueError(
            f"prompt_strs has {len(prompt_strs)} items but output_strs has {len(output_strs)}; expected one output "
            "per prompt"
        )
    if len(prompt_strs) == 0:
        raise ValueError("prompt_strs is empty; expected at least one prompt")
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer has no pad_token_id; set tokenizer.pad_token before tokenizing")
    prompt_ids = tokenizer(list(prompt_strs), add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(list(output_strs), add_special_tokens=False)["input_ids"]
    lengths = [len(p) + len(o) for p, o in zip(prompt_ids, output_ids)]
    max_len = max(lengths)
    batch = len(prompt_ids)
    full = torch.full((batch, max_len), tokenizer.pad_token_id, dtype=torch.long)
    is_output = torch.zeros((batch, max_len), dtype=torch.bool)
    for i, (p, o) in enumerate(zip(prompt_ids, output_ids)):
        full[i, : len(p) + len(o)] = torch.tensor(p + o, dtype=torch.long)
        is_output[i, len(p) : len(p) + len(o)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": is_output[:, 1:]}


def get_response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    attention_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token conditional log-probabilities log p(labels_t | input_ids_{<=t}) under a causal LM.

    Args:
        model: a causal LM whose forward returns ``.logits`` of shape (B, T, V).
        input_ids: (B, T) long.
        labels: (B, T) long, the next-token targets (see ``tokenize_prompt_and_output``).
        return_token_entropy: also return the entropy of each next-token distribution.
        attention_mask: optional (B, T); passed to the model when given.

    Returns:
        dict with ``log_probs`` (B, T) float32 and, when asked, ``token_entropy`` (B, T) float32.
        No masking is applied: mask with the response mask afterwards.

    Raises:
        ValueError: when ``input_ids`` and ``labels`` differ in shape.

    Source: CS336 A5 handout, section 4.2 (``get_response_log_probs``).
    """
    check_same_shape("input_ids", input_ids, "labels", labels)
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    logits = model(input_ids=input_ids, **kwargs).logits.float()
    log_probs = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    out = {"log_probs": log_probs}
    if return_token_entropy:
        out["token_entropy"] = compute_entropy(logits)
    return out


@torch.no_grad()
def mean_response_entropy(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    batch_size: int = 32,
) -> float:
    """Mean next-token entropy (nats, temperature 1) of ``model`` over every completion token of sampled sequences,
    from their exact token ids; a token-weighted mean over all sequences. Runs in eval mode (restored after), no grad.

    Args:
        model: a causal LM whose forward takes ``attention_mask`` and returns ``.logits`` (B, T, V).
        prompt_ids: N token-id lists, one per prompt (non-empty).
        completion_ids: N token-id lists, the completion sampled for each prompt.
        pad_token_id: the id padding is filled with (never read: masked out).
        batch_size: sequences per forward pass.

    Returns:
        The mean entropy over every completion token, a float in nats; 0.0 when there is none.

    Raises:
        ValueError: when ``prompt_ids`` and ``completion_ids`` differ in length.

    Source: CS336 A5 handout, expert iteration (Algorithm 2), which tracks the responses' entropy.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(
            f"prompt_ids has {len(prompt_ids)} sequences but completion_ids has {len(completion_ids)}; expected one "
            "completion per prompt"
        )
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(prompt_ids), batch_size):
        prompts = prompt_ids[start : start + batch_size]
        seqs = [list(p) + list(c) for p, c in zip(prompts, completion_ids[start : start + batch_size])]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        response = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
        for i, (seq, p) in enumerate(zip(seqs, prompts)):
            ids[i, : len(seq)] = torch.tensor(seq)
            attention[i, : len(seq)] = 1
            response[i, len(p) - 1 : len(seq) - 1] = True  # labels that are response tokens
        out = get_response_log_probs(
            model,
            ids[:, :-1].to(device),
            ids[:, 1:].to(device),
            return_token_entropy=True,
            attention_mask=attention[:, :-1].to(device),
        )
        entropy = out["token_entropy"].cpu()
        total += float(entropy[response].sum())
        count += int(response.sum())
    model.train(was_training)
    return total / max(count, 1)


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: Sequence[str],
    repeated_ground_truths: Sequence[str],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score every rollout with ``reward_fn`` and normalize the rewards within each group.

    Args:
        reward_fn: ``reward_fn(response, ground_truth) -> {"reward", "format_reward", "answer_reward"}``;
            ``reward`` is required, the other two are optional. A ``reward`` of None or NaN marks the rollout as
            unscorable: it is excluded from its group's statistics, gets advantage 0, and a warning counts them.
        rollout_responses: N responses, in consecutive groups of ``group_size`` per prompt.
        repeated_ground_truths: N ground truths, each repeated ``group_size`` times.
        group_size: rollouts per prompt.
        advantage_eps: added to the group std before dividing.
        normalize_by_std: divide by the group std (see ``compute_group_advantages``).

    Returns:
        ``(advantages (N,), raw_rewards (N,), metadata)``: float32 tensors (raw rewards keep NaN for unscorable
        rollouts); metadata holds ``reward_mean``, ``reward_std`` (unbiased), ``reward_max``, ``reward_min`` over
        scorable rollouts, ``format_reward_mean`` and ``answer_reward_mean`` (over rollouts that reported them),
        and ``num_excluded``.

    Raises:
        ValueError: when the two lists differ in length, N is not divisible by ``group_size``, ``group_size`` < 2
        with ``normalize_by_std``, or ``reward_fn`` returns something other than a dict with a ``reward`` key.

    Source: CS336 A5 handout, section 7.2 (``compute_group_normalized_rewards``), equation 28.
    """
    if len(rollout_responses) != len(repeated_ground_truths):
        raise ValueError(
            f"rollout_responses has {len(rollout_responses)} items but repeated_ground_truths has "
            f"{len(repeated_ground_truths)}; expected one ground truth per response"
        )
    rewards: list[float] = []
    parts: dict[str, list[float]] = {"format_reward": [], "answer_reward": []}
    for i, (response, truth) in enumerate(zip(rollout_responses, repeated_ground_truths)):
        scores = reward_fn(response, truth)
        if not isinstance(scores, dict) or "reward" not in scores:
            raise ValueError(
                f"reward_fn returned {scores!r} for rollout {i}; expected a dict with a 'reward' key "
                "(and optionally 'format_reward', 'answer_reward')"
            )
        reward = scores["reward"]
        rewards.append(math.nan if reward is None else float(reward))
        for key, values in parts.items():
            if scores.get(key) is not None:
                values.append(float(scores[key]))
    raw_rewards = torch.tensor(rewards, dtype=torch.float32)
    advantages = compute_group_advantages(raw_rewards, group_size, advantage_eps, normalize_by_std)
    valid = raw_rewards[~torch.isnan(raw_rewards)]
    num_excluded = len(rewards) - valid.numel()
    if num_excluded:
        warnings.warn(
            f"{num_excluded} of {len(rewards)} rewards were None or NaN; they were excluded from their group's "
            "mean and std and given advantage 0",
            stacklevel=2,
        )
    nan = float("nan")
    metadata = {
        "reward_mean": valid.mean().item() if valid.numel() else nan,
        "reward_std": valid.std().item() if valid.numel() > 1 else nan,
        "reward_max": valid.max().item() if valid.numel() else nan,
        "reward_min": valid.min().item() if valid.numel() else nan,
        **{f"{key}_mean": sum(values) / len(values) if values else nan for key, values in parts.items()},
        "num_excluded": num_excluded,
    }
    return advantages, raw_rewards, metadata


def grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    length_normalization: str = "masked_mean",
    normalize_constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward-and-backward of one GRPO microbatch.

    per-token loss (``compute_policy_gradient_loss``) -> length normalization and batch mean (``compute_grpo_loss``)
    -> divided by ``gradient_accumulation_steps`` -> ``backward()`` (gradients accumulate across calls).

    Args:
        policy_log_probs: (B, T), requires grad.
        response_mask: (B, T).
        gradient_accumulation_steps: microbatches per optimizer step (>= 1).
        loss_type, raw_rewards, advantages, old_log_probs, cliprange: see
            ``trl_ext.objective.losses.compute_policy_gradient_loss`` (any name of
            ``trl_ext.objective.losses.POLICY_LOSSES``).
        length_normalization, normalize_constant: see ``trl_ext.objective.aggregations.compute_grpo_loss`` (any name of
            ``trl_ext.objective.aggregations.AGGREGATIONS``; ``"token_mean"`` with no constant is the token mean of this
            microbatch).

    Returns:
        ``(loss, metadata)``: the 0-d loss that was back-propagated (already divided by the accumulation steps,
        detached) and the loss function's metadata.

    Raises:
        ValueError: as ``compute_policy_gradient_loss`` and ``compute_grpo_loss``, and for
        ``gradient_accumulation_steps`` < 1.

    Source: CS336 A5 handout, section 7.3 (``grpo_microbatch_train_step``).
    """
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps}; expected an integer >= 1")
    check_same_shape("policy_log_probs", policy_log_probs, "response_mask", response_mask)
    per_token_loss, metadata = compute_policy_gradient_loss(
        policy_log_probs, loss_type, raw_rewards, advantages, old_log_probs, cliprange
    )
    loss = compute_grpo_loss(per_token_loss, response_mask, length_normalization, normalize_constant)
    loss = loss / gradient_accumulation_steps
    loss.backward()
    return loss.detach(), metadata


def sft_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward-and-backward of one SFT microbatch: negative log-likelihood of the response tokens.

    Per example, sum of -log p over response tokens / ``normalize_constant``; mean over the batch; divided by
    ``gradient_accumulation_steps``; ``backward()``.

    Args:
        policy_log_probs: (B, T), requires grad.
        response_mask: (B, T), 1 on response tokens.
        gradient_accumulation_steps: microbatches per optimizer step (>= 1).
        normalize_constant: divisor of each example's summed NLL (default 1.0).

    Returns:
        ``(loss, metadata)``: the back-propagated 0-d loss (detached) and ``{"nll_per_example": (B,)}``.

    Raises:
        ValueError: on a shape mismatch, ``gradient_accumulation_steps`` < 1, or ``normalize_constant`` = 0.

    Source: CS336 A5 handout, section 4.2 (``sft_microbatch_train_step``).
    """
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps}; expected an integer >= 1")
    per_example = masked_normalize(-policy_log_probs, response_mask, dim=-1, normalize_constant=normalize_constant)
    loss = per_example.mean() / gradient_accumulation_steps
    loss.backward()
    return loss.detach(), {"nll_per_example": per_example.detach()}


def per_instance_dpo_loss(
    lm: torch.nn.Module,
    lm_ref: torch.nn.Module,
    tokenizer: Any,
    beta: float,
    prompt: str,
    response_chosen: str,
    response_rejected: str,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """DPO loss of one preference pair, straight from two causal LMs (the course supplement's helper).

    Each response, with EOS appended unless present, follows the same rendered ``prompt`` (tokenized separately,
    ``tokenize_prompt_and_output``); the summed response log-probs (EOS included) under ``lm`` and ``lm_ref`` (no
    grad) go into ``dpo_loss``.

    Args:
        lm: the policy, a causal LM whose forward returns ``.logits``.
        lm_ref: the frozen reference LM (may sit on another device).
        tokenizer: tokenizer of both models, with ``eos_token`` and ``pad_token_id``.
        beta: DPO beta (> 0).
        prompt: the rendered prompt.
        response_chosen: the preferred response (without EOS).
        response_rejected: the dispreferred response.
        label_smoothing: cDPO eps (default 0.0), see ``dpo_loss``.

    Returns:
        0-d tensor (on ``lm``'s device).

    Raises:
        ValueError: when a response is empty, the two responses are identical (h would be 0 whatever the models),
        the tokenizer has no EOS token, or as ``dpo_loss``.

    Source: CS336 A5 supplement (``compute_per_instance_dpo_loss``); Rafailov et al. 2023.
    """
    for name, response in (("response_chosen", response_chosen), ("response_rejected", response_rejected)):
        if not response:
            raise ValueError(f"{name} is empty; expected a non-empty response string")
    if response_chosen == response_rejected:
        raise ValueError(
            "response_chosen and response_rejected are identical; a preference pair needs two different responses"
        )
    eos = tokenizer.eos_token
    if eos is None:
        raise ValueError("tokenizer has no eos_token; the responses must end with EOS")
    outputs = [r if r.endswith(eos) else r + eos for r in (response_chosen, response_rejected)]
    batch = tokenize_prompt_and_output([prompt, prompt], outputs, tokenizer)

    def summed_response_logps(model: torch.nn.Module) -> torch.Tensor:
        device = next(model.parameters()).device
        input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        log_probs = get_response_log_probs(model, input_ids, labels)["log_probs"]
        return masked_normalize(log_probs, batch["response_mask"].to(device), dim=-1)

    policy = summed_response_logps(lm)
    with torch.no_grad():
        ref = summed_response_logps(lm_ref).to(policy.device)
    return dpo_loss(policy[:1], policy[1:], ref[:1], ref[1:], beta, label_smoothing)


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 0.99, lam: float = 0.95) -> torch.Tensor:
    """Generalized advantage estimation.

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}, with A_T = 0, i.e.
    A_t = sum_{l >= 0} (gamma * lam)^l * delta_{t+l}. ``values[..., T]`` is the bootstrap value of the state after
    the last reward (0 for a terminal state).

    Args:
        rewards: (..., T) rewards.
        values: (..., T + 1) value estimates, same leading dimensions.
        gamma: discount factor in [0, 1] (default 0.99).
        lam: GAE lambda in [0, 1] (default 0.95); lam = 1 gives Monte-Carlo returns minus V, lam = 0 the TD error.

    Returns:
        (..., T) advantages, float like ``rewards``, no gradient.

    Raises:
        ValueError: when ``values`` is not one step longer than ``rewards`` or the leading shapes differ.

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation".
    """
    if values.shape[:-1] != rewards.shape[:-1] or values.shape[-1] != rewards.shape[-1] + 1:
        raise ValueError(
            f"values has shape {tuple(values.shape)} and rewards {tuple(rewards.shape)}; "
            "expected values to be (..., T + 1) for rewards (..., T)"
        )
    rewards = rewards.detach()
    values = values.detach().to(rewards.dtype)
    deltas = rewards + gamma * values[..., 1:] - values[..., :-1]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in range(rewards.shape[-1] - 1, -1, -1):
        running = deltas[..., t] + gamma * lam * running
        advantages[..., t] = running
    return advantages
