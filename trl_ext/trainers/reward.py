"""Bradley-Terry reward models: `trl.RewardTrainer` with the loss from `trl_ext.functional.bradley_terry_loss`.

    loss = mean over pairs of -log sigmoid(r_chosen - r_rejected - margin)     (+ TRL's optional centering term)

`margin` comes from an optional per-pair `margin` dataset column (0 when absent). The reward model must give one
scalar per sequence (`num_labels=1`); anything else raises instead of being broadcast. Metrics keep TRL's names:
`accuracy` (fraction of pairs with r_chosen > r_rejected), `margin` (mean r_chosen - r_rejected), `min_reward`,
`mean_reward`, `max_reward`, `num_tokens`. Rows are validated before tokenization
(`trl_ext.data.preferences.check_preference_dataset`): a missing or empty field, or chosen identical to rejected,
raises naming the row, or with `skip_invalid_pairs=True` is dropped with a counting warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trl

from trl_ext import functional
from trl_ext.data.preferences import check_preference_dataset
from trl_ext.trainers.opening import DATA_PARAMS, LOOP_PARAMS, opening_args
from trl_ext.trainers.upstream import TRAINER_MIXIN_SEAMS, TrainerMixin, check_upstream

# Upstream methods trl_ext.RewardTrainer overrides: name -> parameters after self (TRL 1.16.0).
_SEAMS = {
    "__init__": (
        "model",
        "args",
        *DATA_PARAMS,
        *LOOP_PARAMS,
        "optimizer_cls_and_kwargs",
        "preprocess_logits_for_metrics",
        "quantization_config",
        "peft_config",
    ),
    "_prepare_dataset": ("dataset", "processing_class", "args", "dataset_name"),
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    **TRAINER_MIXIN_SEAMS,
}


@dataclass
class RewardConfig(trl.RewardConfig):
    r"""`trl.RewardConfig` plus row validation for `trl_ext.RewardTrainer`.

    Args:
        skip_invalid_pairs (`bool`, defaults to `False`):
            Drop invalid preference rows with one counting warning instead of raising on the first.
    """

    skip_invalid_pairs: bool = field(
        default=False,
        metadata={
            "help": "What to do with a preference row that has a missing or empty prompt/chosen/rejected, chosen "
            "identical to rejected, or a non-numeric margin: False (default) raises a ValueError naming the row; "
            "True drops such rows and warns once with their count."
        },
    )


class RewardTrainer(TrainerMixin, trl.RewardTrainer):
    """`trl.RewardTrainer` whose loss is `trl_ext.functional.bradley_terry_loss` on one scalar reward per sequence.

    Takes everything `trl.RewardTrainer` takes; `args` may also be a `trl.RewardConfig` or a plain
    `transformers.TrainingArguments` (fields copied by value, the others keep their defaults, as `trl.SFTTrainer`
    converts TrainingArguments; upstream's RewardTrainer fails on them).
    Each checkpoint also holds the running token count behind `num_tokens`.

    Raises:
        ValueError: a model without `num_labels=1` (from upstream, at construction), rewards that are not one scalar
        per sequence, an invalid preference row (see `RewardConfig.skip_invalid_pairs`). RuntimeError: the installed
        TRL is untested or lacks a seam this trainer overrides (`trl_ext.trainers.upstream`).
    """

    _tag_names = ["trl", "reward-trainer", "trl_ext"]

    def __init__(self, model: Any, args: trl.RewardConfig | None = None, *pos_args: Any, **kwargs: Any):
        check_upstream(trl.RewardTrainer, _SEAMS)
        args = opening_args(RewardConfig, model, args, "Reward")
        super().__init__(model, args, *pos_args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        dataset = check_preference_dataset(dataset, skip_invalid=args.skip_invalid_pairs, name=dataset_name)
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Mirrors trl 1.16.0 `RewardTrainer.compute_loss`: upstream runs the forward and logs num_tokens,
        # min/mean/max_reward, accuracy and margin; the loss it returns is replaced by the course's Bradley-Terry loss
        # on the same rewards, after checking that they are one scalar per sequence (upstream's squeeze/chunk would
        # silently pair up the columns of a wider head).
        _, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        rewards = outputs.logits
        num_sequences = inputs["input_ids"].shape[0]
        if rewards.dim() != 2 or rewards.shape != (num_sequences, 1) or num_sequences % 2:
            raise ValueError(
                f"the reward model returned logits of shape {tuple(rewards.shape)} for {num_sequences} sequences; "
                "expected (2B, 1): one scalar per sequence, B chosen then B rejected (set num_labels=1)"
            )
        chosen, rejected = rewards[:, 0].chunk(2)
        loss = functional.bradley_terry_loss(chosen, rejected, margin=inputs.get("margin"))
        if self.args.center_rewards_coefficient is not None:  # upstream's reward centering (Eisenstein et al. 2023)
            loss = loss + self.args.center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
        return (loss, outputs) if return_outputs else loss
