"""DPO with the course's per-instance loss: `trl.DPOTrainer` whose sigmoid loss comes from `trl_ext.functional`.

With h = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x)), log-probs summed over the
response tokens (EOS included, prompt excluded):

    loss = mean over pairs of (1 - eps) * (-log sigmoid(beta * h)) + eps * (-log sigmoid(-beta * h))

eps = `label_smoothing` = 0 is DPO (Rafailov et al. 2023), and then the loss equals upstream's `loss_type="sigmoid"`;
eps > 0 is conservative DPO (cDPO, Mitchell 2023), which upstream's sigmoid loss no longer implements. This loss is
used for `loss_type=["sigmoid"]` with the default f-divergence (`reverse_kl`), no `ld_alpha`, no WPO weighting and no
MoE aux loss; every other configuration is computed by upstream unchanged. Metrics keep TRL's names and definitions
(TRL 1.16 `DPOTrainer._compute_loss`): `rewards/chosen`, `rewards/rejected` (implicit rewards beta * (log pi - log
pi_ref)), `rewards/accuracies` (fraction of pairs with chosen reward > rejected reward), `rewards/margins` (mean beta *
h), `logps/chosen`, `logps/rejected`, `logits/chosen`, `logits/rejected` (mean over completion tokens of the mean
logit over the vocabulary), `mean_token_accuracy` (fraction of chosen completion tokens that are the model's top-1),
`entropy`, `num_tokens`. Rows are validated before tokenization as in `trl_ext.RewardTrainer`.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import trl

from trl_ext import functional
from trl_ext.data.preferences import check_preference_dataset
from trl_ext.data.prompts import strip_leading_bos_columns
from trl_ext.trainers.opening import DATA_PARAMS, LOOP_PARAMS, opening_args
from trl_ext.trainers.upstream import TRAINER_MIXIN_SEAMS, TrainerMixin, check_upstream

logger = logging.getLogger(__name__)

_NON_MODEL_KEYS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}

# Upstream loss types that read label_smoothing (TRL 1.16 DPOTrainer._compute_loss); "sigmoid" reads it here (cDPO).
_SMOOTHED_LOSS_TYPES = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")

# Upstream methods trl_ext.DPOTrainer overrides or calls: name -> parameters after self (TRL 1.16.0).
_SEAMS = {
    "__init__": ("model", "ref_model", "args", *DATA_PARAMS, *LOOP_PARAMS, "quantization_config", "peft_config"),
    "_prepare_dataset": ("dataset", "processing_class", "args", "dataset_name"),
    "_compute_loss": ("model", "inputs", "return_outputs"),
    "compute_ref_log_probs": ("model", "inputs"),
    **TRAINER_MIXIN_SEAMS,
}


@dataclass
class DPOConfig(trl.DPOConfig):
    r"""`trl.DPOConfig` with cDPO label smoothing for the sigmoid loss, and row validation.

    Args:
        label_smoothing (`float`, defaults to `0.0`):
            Upstream field; with `loss_type=["sigmoid"]` it is the cDPO eps in [0, 0.5] (probability that a
            preference label is flipped). Other loss types use it as upstream does.
        skip_invalid_pairs (`bool`, defaults to `False`):
            Drop invalid preference rows with one counting warning instead of raising on the first.
    """

    label_smoothing: float = field(
        default=0.0,
        metadata={
            "help": "With loss_type=['sigmoid'] (default): the cDPO eps in [0, 0.5], the assumed probability that a "
            "preference label is flipped; loss = (1-eps)(-log sigmoid(beta h)) + eps(-log sigmoid(-beta h)); 0 "
            "(default) is plain DPO. For 'robust' (eps in [0, 0.5)), 'exo_pair', 'aot' and 'aot_unpaired' it keeps "
            "its upstream meaning. A positive value with loss types that all ignore it raises."
        },
    )
    skip_invalid_pairs: bool = field(
        default=False,
        metadata={
            "help": "What to do with a preference row that has a missing or empty prompt/chosen/rejected or chosen "
            "identical to rejected: False (default) raises a ValueError naming the row; True drops such rows and "
            "warns once with their count."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type == ["sigmoid"] and not 0.0 <= self.label_smoothing <= 0.5:
            raise ValueError(
                f"label_smoothing={self.label_smoothing!r} with loss_type=['sigmoid']; "
                "expected the cDPO eps in [0, 0.5]"
            )
        if self.label_smoothing != 0.0 and not set(self.loss_type) & set(_SMOOTHED_LOSS_TYPES):
            raise ValueError(
                f"label_smoothing={self.label_smoothing!r} would be ignored by loss_type={self.loss_type}; it is used "
                f"by {list(_SMOOTHED_LOSS_TYPES)} only. Set label_smoothing=0 or pick one of those loss types."
            )
        if "robust" in self.loss_type and not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(
                f"label_smoothing={self.label_smoothing!r} with loss_type 'robust'; expected eps in [0, 0.5): the "
                "robust loss divides by 1 - 2 * eps (infinite at 0.5, sign-flipped objective above)"
            )


def _frozen_reference(model: Any, args: DPOConfig, peft_config: Any) -> Any:
    """The reference model trl_ext.DPOTrainer builds when none is given: a frozen copy of `model`, or None where
    upstream's own choice stands (see `DPOTrainer`).

    Raises:
        ValueError: upstream would load the reference from `model.config._name_or_path` and that is empty (a model
            built in memory under DeepSpeed ZeRO-3 or quantized); the message says to pass `ref_model`.
    """
    from accelerate.utils import is_peft_model
    from transformers.integrations import is_deepspeed_zero3_enabled

    if isinstance(model, str) or is_peft_model(model) or peft_config is not None:
        return None  # loaded by name like the policy, or the adapter-disabled base
    fsdp = bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")
    if args.precompute_ref_log_probs and not fsdp:
        return None  # upstream computes the reference log-probs with the policy before training
    quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    if is_deepspeed_zero3_enabled() or quantized:  # partitioned / quantized weights: no plain copy
        if not getattr(model.config, "_name_or_path", ""):
            raise ValueError(
                "DPOTrainer: the model has no name_or_path to load the reference model from "
                f"({'DeepSpeed ZeRO-3' if not quantized else 'a quantized model'} cannot be copied); pass ref_model"
            )
        return None
    logger.info("DPOTrainer: no ref_model given; the reference is a frozen copy of the model as passed.")
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


class DPOTrainer(TrainerMixin, trl.DPOTrainer):
    """`trl.DPOTrainer` computing the sigmoid loss with `trl_ext.functional.dpo_loss` (cDPO when label_smoothing > 0).

    Takes `trl.DPOTrainer`'s arguments; `args` may be a `trl.DPOConfig` or `TrainingArguments` (copied into a
    `trl_ext.DPOConfig`). Checkpoints also hold the `num_tokens` count. Without `ref_model`, a non-PEFT model object
    gets a frozen deep copy of itself as reference (upstream reloads `config._name_or_path`); PEFT, a model by name,
    `precompute_ref_log_probs`, ZeRO-3 and quantized models keep upstream's reference.

    Raises:
        ValueError: `label_smoothing` > 0 except with "sigmoid" alone; an invalid preference row (see
            `DPOConfig.skip_invalid_pairs`); whatever `trl.DPOTrainer` raises.
        RuntimeError: an untested TRL or a missing seam (`trl_ext.trainers.upstream`)."""

    _tag_names = ["trl", "dpo", "trl_ext"]

    def __init__(
        self, model: Any, ref_model: Any = None, args: trl.DPOConfig | None = None, *pos_args: Any, **kwargs: Any
    ):
        check_upstream(trl.DPOTrainer, _SEAMS)
        args = opening_args(DPOConfig, model, args, "DPO")
        if ref_model is None:
            peft_config = (
                inspect.signature(trl.DPOTrainer.__init__)
                .bind(self, model, ref_model, args, *pos_args, **kwargs)
                .arguments.get("peft_config")
            )
            ref_model = _frozen_reference(model, args, peft_config)
        super().__init__(model, ref_model, args, *pos_args, **kwargs)
        self.uses_course_loss = (
            self.loss_types == ["sigmoid"]
            and self.loss_weights == [1.0]
            and self.f_divergence_type == "reverse_kl"
            and self.ld_alpha is None
            and not self.use_weighting
            and not self.aux_loss_enabled
        )
        if args.label_smoothing > 0 and "sigmoid" in self.loss_types and not self.uses_course_loss:
            raise ValueError(
                f"label_smoothing={args.label_smoothing} (cDPO) is implemented for loss_type=['sigmoid'] alone with "
                "f_divergence_type='reverse_kl', no ld_alpha, use_weighting=False and no MoE aux loss; got "
                f"loss_type={self.loss_types}, f_divergence_type={self.f_divergence_type!r}, ld_alpha={self.ld_alpha}, "
                f"use_weighting={self.use_weighting}."
            )

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        dataset = check_preference_dataset(dataset, skip_invalid=args.skip_invalid_pairs, name=dataset_name)
        # One BOS: TRL tokenizes plain-text prompts with special tokens; a prompt rendered with a template that writes
        # BOS would get a second one (trl_ext.data.strip_leading_bos).
        dataset = strip_leading_bos_columns(dataset, processing_class, ("prompt", "chosen", "rejected"))
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _compute_loss(self, model, inputs, return_outputs):
        # Mirrors trl 1.16.0 `DPOTrainer._compute_loss` for its default configuration (see `uses_course_loss`): the
        # same fused-head forward and reference log-probs (upstream's `compute_ref_log_probs`), the loss from
        # `trl_ext.functional.dpo_loss`, and upstream's reward/logp/entropy/num_tokens metrics.
        if not self.uses_course_loss:
            return super()._compute_loss(model, inputs, return_outputs)
        mode = "train" if self.model.training else "eval"
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
        outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
        shift_completion_mask = completion_mask[..., 1:]
        seq_len = shift_completion_mask.size(1)  # prompt-learning PEFT prepends virtual tokens: keep the real ones
        chosen_logps, rejected_logps = outputs.log_probs[:, -seq_len:].sum(dim=1).chunk(2, dim=0)

        if self.precompute_ref_logps:
            ref_chosen_logps, ref_rejected_logps = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            ref_model = self.ref_model if self.ref_model is not None else self.model  # PEFT: adapters disabled there
            ref_chosen_logps, ref_rejected_logps = self.compute_ref_log_probs(ref_model, inputs)

        loss = functional.dpo_loss(
            chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, self.beta, self.label_smoothing
        )

        gather = self.accelerator.gather_for_metrics
        with torch.no_grad():
            entropy_sum = gather((outputs.entropy[:, -seq_len:] * shift_completion_mask).sum()).sum()
            total_tokens = gather(shift_completion_mask.sum()).sum()
            # A token mean over no completion token (all truncated away, on every process) is not logged; upstream
            # logs 0.0 there, which its log() would average into the logging window as if it were a value.
            if total_tokens > 0:
                self._metrics[mode]["entropy"].append((entropy_sum / total_tokens).item())
            if mode == "train":
                self._total_train_tokens += gather(inputs["attention_mask"].sum()).sum().item() // self._tp_size
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            chosen_rewards = self.beta * (chosen_logps - ref_chosen_logps)
            rejected_rewards = self.beta * (rejected_logps - ref_rejected_logps)
            all_chosen, all_rejected = (
                self.accelerator.gather(chosen_rewards),
                self.accelerator.gather(rejected_rewards),
            )
            self._metrics[mode]["rewards/chosen"].append(all_chosen.mean().item())
            self._metrics[mode]["rewards/rejected"].append(all_rejected.mean().item())
            self._metrics[mode]["rewards/accuracies"].append((all_chosen > all_rejected).float().mean().item())
            self._metrics[mode]["rewards/margins"].append((all_chosen - all_rejected).mean().item())
            self._metrics[mode]["logps/chosen"].append(self.accelerator.gather(chosen_logps).mean().item())
            self._metrics[mode]["logps/rejected"].append(self.accelerator.gather(rejected_logps).mean().item())
            # As upstream: token-weighted mean logit of the chosen/rejected completions, and top-1 accuracy of chosen
            chosen_mask, rejected_mask = shift_completion_mask.bool().chunk(2, dim=0)
            chosen_mean_logits, rejected_mean_logits = outputs.mean_logits[:, -seq_len:].chunk(2, dim=0)
            chosen_is_top1, _ = outputs.is_top1[:, -seq_len:].chunk(2, dim=0)
            for name, values, keep in (
                ("logits/chosen", chosen_mean_logits, chosen_mask),
                ("logits/rejected", rejected_mean_logits, rejected_mask),
                ("mean_token_accuracy", chosen_is_top1.float(), chosen_mask),
            ):
                total, count = gather(values[keep].sum()).sum().item(), gather(keep.sum()).sum().item()
                if count > 0:
                    self._metrics[mode][name].append(total / count)

        if return_outputs:  # deprecated upstream: the fused head builds no logits, so they take an extra forward
            with torch.no_grad():
                outputs = model(**model_kwargs)
        return (loss, outputs) if return_outputs else loss
