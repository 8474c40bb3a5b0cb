"""The terms and masks ``trl.GRPOTrainer._compute_loss`` (TRL 1.16) applies around the policy loss, in its order.

``GRPOLossTermsMixin`` gives ``trl_ext.GRPOTrainer._compute_loss``:

- ``top_entropy_quantile`` < 1 (Wang et al. 2025, arXiv:2506.01939): the policy loss only on tokens whose entropy is in
  the top quantile of every process's response tokens (upstream's ``get_high_entropy_mask``);
- ``off_policy_mask_threshold`` (DeepSeek-V3.2, arXiv:2512.02556, eq. 9): a negative-advantage sequence whose mean
  KL(sampler || policy) exceeds the threshold is dropped (upstream's ``get_off_policy_mask``); both multiply the
  per-token policy loss before the vLLM correction and the KL (``_policy_loss_masks``);
- ``entropy_coef`` / ``use_adaptive_entropy`` (Skywork-OR1, arXiv:2505.22312): the aggregated loss minus ``coef x`` the
  mean entropy (``_entropy_bonus``); its adaptive state is upstream's and also saved in trl_ext's checkpoint state, so a
  resume is exact.

A bonus gives zero-advantage rows a gradient, so ``skip_zero_advantage_rows`` turns itself off under it (one log line);
``dynamic_sampling`` stays valid. All off by default, as upstream.
"""

from __future__ import annotations

from typing import Any

import torch

from trl_ext.objective.aggregations import AGGREGATIONS


class GRPOLossTermsMixin:
    """Upstream's entropy mask, off-policy sequence mask and entropy bonus for ``trl_ext.GRPOTrainer._compute_loss``
    (see the module docstring). Reads the attributes ``trl.GRPOTrainer.__init__`` sets from the config
    (``top_entropy_quantile``, ``off_policy_mask_threshold``, ``entropy_coef``, ``use_adaptive_entropy``,
    ``_entropy_bonus_enabled``, ``_last_world_entropy``, ``_entropy_window_stats``) and calls upstream's helpers."""

    def _policy_loss_masks(
        self,
        inputs: dict[str, Any],
        per_token_logps: torch.Tensor,
        old_log_probs: torch.Tensor,
        entropies: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The masks upstream multiplies the per-token policy loss by (trl.GRPOTrainer._compute_loss, TRL 1.16).

        Args:
            inputs: the batch (``sampling_per_token_logps`` with vLLM).
            per_token_logps, old_log_probs, entropies, mask: (B, T).
            advantages: (B, 1).

        Returns:
            ``(loss_mask, entropy_mask)``: the product of the off-policy mask (B, 1) and the top-entropy mask (B, T),
            each where its option is on (None when both are off), and the entropy mask alone (or None)."""
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:  # a collective (every process's entropies): every rank calls it
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        loss_mask = None
        if self.off_policy_mask_threshold is not None:
            loss_mask = self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_log_probs),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        if entropy_mask is not None:
            loss_mask = entropy_mask if loss_mask is None else loss_mask * entropy_mask
        # 0/1 factors: multiplying by their product is multiplying by each in turn, as upstream does
        return loss_mask, entropy_mask

    def _entropy_bonus(
        self,
        entropies: torch.Tensor,
        mask: torch.Tensor,
        entropy_mask: torch.Tensor | None,
        policy_loss: torch.Tensor,
        accumulation: float,
        mode: str,
    ) -> torch.Tensor | float:
        """The entropy term to subtract from this micro-batch's loss, as trl.GRPOTrainer._compute_loss (TRL 1.16): logs
        ``policy_loss`` and ``entropy_coef``; with ``use_adaptive_entropy`` in training, adds to the step's entropy
        window and updates the coefficient at the step's end.

        Args:
            entropies: (B, T) per-token entropies, with gradient.
            mask: (B, T) response mask.
            entropy_mask: (B, T) bool from ``_policy_loss_masks`` or None.
            policy_loss: 0-d aggregated loss before the division by ``accumulation`` (logged as TRL 1.16 does: after the
                division for the ``batch_tokens`` aggregations, before it for the others).
            accumulation: the gradient accumulation steps (1 in evaluation).
            mode: ``"train"`` or ``"eval"``.

        Returns:
            0-d: ``coef x (masked sum of entropies) / (tokens, at least 1) / accumulation`` (adaptive: 0 while the last
            step's entropy was above ``entropy_target``, and at the first step)."""
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
        if self.use_adaptive_entropy:
            coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            coef = self.entropy_coef
        if AGGREGATIONS.get(self.args.length_normalization).divisor == "batch_tokens":
            policy_loss = policy_loss / accumulation  # upstream divides its normalizer by the steps beforehand
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss.detach()).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":  # evaluation never moves the controller
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:  # the optimizer step's last micro-batch: every process's window
                totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(
                        self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max
                    )
                else:
                    self.entropy_coef = max(
                        self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min
                    )
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * entropy_loss

    # -- the adaptive controller's state in trl_ext's checkpoint state (trl_ext.trainers.upstream.TrainerMixin) ----

    def _checkpoint_state(self) -> dict[str, Any]:
        state = super()._checkpoint_state()
        if self.use_adaptive_entropy:
            state["entropy_control"] = {
                "entropy_coef": self.entropy_coef,
                "last_world_entropy": self._last_world_entropy,  # inf before the first step: JSON's Infinity
            }
        return state

    def _restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        super()._restore_checkpoint_state(state)
        # after upstream's _load_optimizer_and_scheduler read entropy_ctrl_state.json: the same values, or the only
        # ones when a kill came between trainer_state.json and upstream's file
        if self.use_adaptive_entropy and state.get("entropy_control") is not None:
            self.entropy_coef = state["entropy_control"]["entropy_coef"]
            self._last_world_entropy = state["entropy_control"]["last_world_entropy"]
