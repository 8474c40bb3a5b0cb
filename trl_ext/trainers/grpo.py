"""GRPO with the course's advantages, loss and KL, everything else from ``trl.GRPOTrainer``.

Two seams in TRL 1.16 are swapped, nothing else:

- advantages: ``_calculate_rewards`` returns the rewards of every process's completions (gathered); we keep them,
  let upstream ``_generate_and_score_completions`` run, then replace its ``advantages`` with
  ``functional.compute_group_advantages`` (or the raw rewards for ``pg_loss_type="no_baseline"``), sliced for
  this process;
- loss: ``_compute_loss`` is rebuilt from ``functional.compute_policy_gradient_loss``, ``functional.compute_kl``
  and ``functional.compute_grpo_loss``; log-probs and entropies still come from upstream
  ``_get_per_token_logps_and_entropies``.

Generation (transformers or vLLM), reward calling, reference model / PEFT adapter handling, old log-probs for
``num_iterations > 1``, the vLLM importance-sampling correction, logging and checkpointing are TRL's.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
import trl

from .. import functional as F

# Upstream options whose math this trainer does not implement: name -> (value meaning "off", why).
_UNSUPPORTED = {
    "importance_sampling_level": ("token", "sequence-level ratios (GSPO) are not part of the course loss"),
    "top_entropy_quantile": (1.0, "entropy masking is not part of the course loss"),
    "entropy_coef": (0.0, "an entropy bonus is not part of the course loss"),
    "use_adaptive_entropy": (False, "an entropy bonus is not part of the course loss"),
    "off_policy_mask_threshold": (None, "off-policy sequence masking is not part of the course loss"),
    "delta": (None, "two-sided clipping is not part of GRPO-Clip"),
    "multi_objective_aggregation": ("sum_then_normalize", "rewards are summed, then normalized per group"),
}


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """``trl.GRPOConfig`` plus the course's choices (CS336 A5, sections 7.2-7.3).

    ``loss_type`` and ``scale_rewards`` are derived from ``length_normalization`` and ``normalize_by_std`` (leave
    them unset; a conflicting value raises). ``epsilon`` is the GRPO-Clip ``cliprange``; ``beta`` the KL weight.
    """

    pg_loss_type: str = field(
        default="grpo_clip",
        metadata={
            "help": "Policy-gradient loss: 'grpo_clip' (default; -min(ratio*A, clip(ratio, 1-epsilon, 1+epsilon)*A)), "
            "'grpo_no_clip' (-ratio*A, the handout's clip ablation; ratio = pi/pi_old, so it stays off-policy-correct "
            "with num_iterations > 1), 'reinforce_with_baseline' (-A * log p with group-normalized A) or 'no_baseline' "
            "(-r * log p with the raw reward r). CS336 A5 sections 7.2 and 8."
        },
    )
    advantage_eps: float = field(
        default=1e-6,
        metadata={"help": "Added to the group std before dividing (default 1e-6; TRL hard-codes 1e-4). >= 0."},
    )
    normalize_by_std: bool = field(
        default=True,
        metadata={
            "help": "Divide the group-centred reward by the group's unbiased std + advantage_eps (default True, GRPO). "
            "False keeps only the mean baseline (Dr. GRPO). Sets TRL's scale_rewards to 'group' or 'none'."
        },
    )
    length_normalization: str = field(
        default="masked_mean",
        metadata={
            "help": "How per-token losses become one loss per response: 'masked_mean' (default, mean over the response "
            "tokens) or 'masked_normalize' (sum divided by max_completion_length, Dr. GRPO). Sets TRL's loss_type to "
            "'grpo' or 'dr_grpo'."
        },
    )
    kl_estimator: str = field(
        default="k3",
        metadata={
            "help": "Per-token KL(pi || pi_ref) estimator used when beta > 0: 'k1', 'k2' or 'k3' (default; Schulman 2020, "
            "the one TRL uses). With a PEFT model the reference is the base model with the adapter disabled."
        },
    )
    kl_target: float | None = field(
        default=None,
        metadata={
            "help": "Target KL for the adaptive KL coefficient (Ziegler et al. 2019). None (default) keeps beta fixed. "
            "When set, beta (> 0 required, the starting value) is updated after every optimizer step and logged as "
            "'beta'."
        },
    )
    kl_horizon: float = field(
        default=10000.0,
        metadata={
            "help": "Horizon of the adaptive KL controller in samples (default 10000, as in Ziegler et al.): each step "
            "changes beta by at most a factor 1 +- 0.2 * samples_per_step / kl_horizon."
        },
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={
            "help": "Multiply the per-token KL by the importance ratio pi/pi_old (DeepSeek-V3.2). Default False: the "
            "course's plain KL estimate (TRL's default is True)."
        },
    )
    loss_type: str | None = field(
        default=None,
        metadata={"help": "Derived from length_normalization ('grpo' or 'dr_grpo'); leave unset."},
    )
    scale_rewards: str | None = field(
        default=None,
        metadata={"help": "Derived from normalize_by_std ('group' or 'none'); leave unset."},
    )

    def __post_init__(self):
        choices = {
            "pg_loss_type": F.PG_LOSS_TYPES,
            "length_normalization": F.LENGTH_NORMALIZATIONS,
            "kl_estimator": F.KL_ESTIMATORS,
        }
        for name, allowed in choices.items():
            F._check_choice(name, getattr(self, name), allowed)
        if self.advantage_eps < 0:
            raise ValueError(f"advantage_eps={self.advantage_eps}; expected a float >= 0")
        derived = {
            "loss_type": {"masked_mean": "grpo", "masked_normalize": "dr_grpo"}[self.length_normalization],
            "scale_rewards": "group" if self.normalize_by_std else "none",
        }
        source = {"loss_type": "length_normalization", "scale_rewards": "normalize_by_std"}
        for name, value in derived.items():
            given = getattr(self, name)
            given = {True: "group", False: "none"}.get(given, given) if name == "scale_rewards" else given
            if given not in (None, value):
                raise ValueError(
                    f"{name}={given!r} conflicts with {source[name]}={getattr(self, source[name])!r}, which implies "
                    f"{name}={value!r}; set {source[name]} instead of {name}"
                )
            setattr(self, name, value)
        for name, (off, why) in _UNSUPPORTED.items():
            if getattr(self, name) != off:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by trl_ext.GRPOTrainer ({why}); use {off!r}")
        if self.epsilon_high not in (None, self.epsilon):
            raise ValueError(
                f"epsilon_high={self.epsilon_high} differs from epsilon={self.epsilon}; GRPO-Clip clips symmetrically"
            )
        for flag, module in (("use_vllm", "vllm"), ("use_liger_kernel", "liger_kernel")):
            if getattr(self, flag) and importlib.util.find_spec(module) is None:
                raise ImportError(f"{flag}=True needs the '{module}' package: install the GPU extra with `uv sync --extra gpu`")
        if self.kl_target is not None and not (self.beta > 0 and self.kl_target > 0 and self.kl_horizon > 0):
            raise ValueError(
                f"kl_target={self.kl_target} needs beta > 0 (the starting coefficient), kl_target > 0 and "
                f"kl_horizon > 0; got beta={self.beta}, kl_horizon={self.kl_horizon}"
            )
        super().__post_init__()


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose advantages, policy loss and KL are the course's (``trl_ext.functional``).

    Takes the same arguments as ``trl.GRPOTrainer`` with ``args`` a ``trl_ext.GRPOConfig``. Metrics keep TRL's names
    (``reward``, ``entropy``, ``kl``, ``clip_ratio/*``, ``completions/*``) and add ``beta`` when it adapts.

    Raises:
        TypeError: when ``args`` is not a ``trl_ext.GRPOConfig``.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"args must be a trl_ext.GRPOConfig, got {type(config).__name__}")
        super().__init__(*args, **kwargs)
        self._gathered_rewards: torch.Tensor | None = None
        self._kl_window = torch.zeros(2)  # [sum of per-token KL, token count] since the last optimizer step

    # -- advantages -------------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # Upstream returns (num_processes * local_batch, num_reward_funcs), gathered; keep it for the advantages.
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gathered_rewards = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        rewards_per_func = self._gathered_rewards
        # Weighted sum of the reward functions; NaN where every function returned None (unscorable), as upstream.
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        train = self.model.training
        group_size = self.num_generations if train else self.num_generations_eval
        if self.args.pg_loss_type == "no_baseline":
            advantages = torch.nan_to_num(rewards, nan=0.0)
        else:
            advantages = F.compute_group_advantages(
                rewards,
                group_size,
                advantage_eps=self.args.advantage_eps,
                normalize_by_std=self.args.normalize_by_std and group_size > 1,
            ).to(rewards.device)
        local = output["completion_ids"].size(0)
        start = self.accelerator.process_index * local
        output["advantages"] = advantages[start : start + local]
        # Upstream logged its own advantages for the completions table: replace them with ours.
        for _ in range(min(len(advantages), len(self._logs["advantages"]))):
            self._logs["advantages"].pop()
        self._logs["advantages"].extend(advantages.tolist())
        return output

    # -- loss ---------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        # Mirrors trl.GRPOTrainer._compute_loss (TRL 1.16) for the per-token log-probs, then applies the course loss.
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KEYS if key in inputs},
        )
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        advantages = inputs["advantages"].unsqueeze(1)
        old_log_probs = inputs.get("old_per_token_logps")
        old_log_probs = per_token_logps.detach() if old_log_probs is None else old_log_probs

        per_token_loss, pg_metadata = F.compute_policy_gradient_loss(
            per_token_logps,
            self.args.pg_loss_type,
            raw_rewards=advantages,  # for "no_baseline", "advantages" holds the raw rewards (see above)
            advantages=advantages,
            old_log_probs=old_log_probs,
            cliprange=self.args.epsilon,
        )
        if self.use_vllm and self.vllm_importance_sampling_correction:
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]  # TRL's sampler-mismatch correction
        if self.beta != 0.0:
            per_token_kl = F.compute_kl(per_token_logps, inputs["ref_per_token_logps"], self.args.kl_estimator)
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(per_token_logps - old_log_probs)
            per_token_loss = per_token_loss + self.beta * per_token_kl

        loss = F.compute_grpo_loss(
            per_token_loss,
            mask,
            self.args.length_normalization,
            normalize_constant=self.max_completion_length,
            allow_empty_rows=True,
        )
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss / accumulation
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        self._log_loss_metrics(mode, mask, entropies, advantages, pg_metadata, per_token_kl if self.beta != 0.0 else None)
        return loss

    def _log_loss_metrics(self, mode, mask, entropies, advantages, pg_metadata, per_token_kl):
        def global_masked_sum_count(x):
            local = torch.stack([torch.where(mask.bool(), x.float(), 0.0).sum(), mask.sum().float()])
            return self.accelerator.reduce(local, reduction="sum")

        def global_masked_mean(x):
            total, count = global_masked_sum_count(x).tolist()
            return total / max(count, 1.0)

        self._metrics[mode]["entropy"].append(global_masked_mean(entropies))
        if per_token_kl is not None:
            kl_sum_count = global_masked_sum_count(per_token_kl.detach())
            self._metrics[mode]["kl"].append(kl_sum_count[0].item() / max(kl_sum_count[1].item(), 1.0))
            if mode == "train" and self.args.kl_target is not None:
                self._update_adaptive_beta(kl_sum_count.cpu())
        if "clipped" in pg_metadata:
            clipped = pg_metadata["clipped"]
            positive = (advantages > 0).expand_as(clipped)
            self._metrics[mode]["clip_ratio/low_mean"].append(global_masked_mean(clipped & ~positive))
            self._metrics[mode]["clip_ratio/high_mean"].append(global_masked_mean(clipped & positive))
            self._metrics[mode]["clip_ratio/region_mean"].append(global_masked_mean(clipped))
        if "ratio" in pg_metadata:  # importance ratio pi/pi_old over response tokens (1 on-policy)
            ratio = pg_metadata["ratio"]
            self._metrics[mode]["ratio/mean"].append(global_masked_mean(ratio))
            big = torch.finfo(ratio.dtype).max
            local = torch.stack([torch.where(mask.bool(), ratio, big).min().neg(), torch.where(mask.bool(), ratio, -big).max()])
            low, high = self.accelerator.reduce(local, reduction="max").tolist() if self.accelerator.num_processes > 1 else local.tolist()
            self._metrics[mode]["ratio/min"].append(-low)
            self._metrics[mode]["ratio/max"].append(high)

    def _update_adaptive_beta(self, kl_sum_count: torch.Tensor) -> None:
        """Accumulate the KL of this micro-batch; at the optimizer step, update beta (Ziegler et al. 2019)."""
        self._kl_window += kl_sum_count
        if not self.accelerator.sync_gradients:
            return
        measured = (self._kl_window[0] / self._kl_window[1].clamp(min=1.0)).item()
        samples = self.args.per_device_train_batch_size * self.accelerator.num_processes * self.current_gradient_accumulation_steps
        self.beta = F.adaptive_kl_coefficient(self.beta, measured, self.args.kl_target, self.args.kl_horizon, samples)
        self._kl_window.zero_()
        self._metrics["train"]["beta"].append(self.beta)


# Model-input keys upstream passes to _get_per_token_logps_and_entropies (multimodal extras), TRL 1.16.
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
