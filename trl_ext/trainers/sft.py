"""Instruction tuning with a safety penalty: ``trl.SFTTrainer`` plus an unlikelihood term on unsafe responses.

    loss = CE + safety_penalty_weight * penalty

* CE: upstream TRL's completion-only cross-entropy, unchanged (EOS included, TRL's token count normalization).
* penalty = unlikelihood + banned_tokens, each a mean over the batch's rows: Welleck et al. 2019's -log(1 - p) over the
  row's ``unsafe_completion`` tokens (``functional.unlikelihood_loss``; 0 without one), and with ``banned_strings``
  -log(1 - sum p(first token of each banned string)) per completion position
  (``functional.banned_token_unlikelihood_loss``).

Logs ``ce_loss``, ``safety_penalty`` (and ``safety_penalty/unlikelihood``, ``/banned_tokens``) beside TRL's metrics, in
``loss``'s units. Every rank runs the same forwards each step: a batch without an unsafe row gets a placeholder row that
adds exactly 0 (a forward only some ranks run hangs DDP, FSDP2 or ZeRO-3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import trl
from datasets import Dataset
from trl.data_utils import is_conversational

from trl_ext import functional
from trl_ext.data.prompts import strip_leading_bos_columns
from trl_ext.trainers.opening import DATA_PARAMS, LOOP_PARAMS, opening_args
from trl_ext.trainers.upstream import TRAINER_MIXIN_SEAMS, TrainerMixin, check_upstream

UNSAFE_COMPLETION_COLUMN = "unsafe_completion"
"""Dataset column with a response the model must not give (plain text, or None/"" for none)."""

_UNSAFE_ROW_KEYS = ("unsafe_input_ids", "unsafe_labels")
_UNSAFE_BATCH_KEYS = ("unsafe_input_ids", "unsafe_attention_mask", "unsafe_labels", "unsafe_num_rows")

# Upstream methods trl_ext.SFTTrainer overrides: name -> parameters after self (TRL 1.16.0).
_SEAMS = {
    "__init__": (
        "model",
        "args",
        *DATA_PARAMS,
        "compute_loss_func",
        *LOOP_PARAMS,
        "optimizer_cls_and_kwargs",
        "preprocess_logits_for_metrics",
        "quantization_config",
        "peft_config",
        "formatting_func",
    ),
    "_prepare_dataset": ("dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name"),
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    "_set_signature_columns_if_needed": (),
    **TRAINER_MIXIN_SEAMS,
}


@dataclass
class SFTConfig(trl.SFTConfig):
    r"""`trl.SFTConfig` plus the safety penalty of `trl_ext.SFTTrainer`.

    Args:
        safety_penalty_weight (`float`, defaults to `0.1`):
            Weight of the safety penalty added to the cross-entropy; 0 trains with TRL's loss alone.
        banned_strings (`list[str]` or `None`, defaults to `None`):
            Strings the model should never start; adds the probability mass on their first tokens to the penalty.
        completion_only_loss (`bool` or `None`, defaults to `None`):
            Upstream field and default: None trains on the completion only where the data has a prompt/completion
            split (a prompt-completion dataset, or, beyond upstream, a pre-tokenized one with a `completion_mask`).
    """

    completion_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Train only on completion tokens. None (default, as upstream) decides by the data: prompt-"
            "completion datasets and (unlike upstream, which then trains on every token) pre-tokenized datasets with "
            "a `completion_mask` column train on the completion only; language-modeling data (a `text` column, or a "
            "`formatting_func`) trains on every token. True requires a prompt/completion split (upstream raises with "
            "a formatting_func); False trains on every token."
        },
    )
    safety_penalty_weight: float = field(
        default=0.1,
        metadata={
            "help": "Weight (>= 0, default 0.1) of the safety penalty in loss = CE + weight * penalty. The penalty "
            "is the unlikelihood -log(1 - p) of the tokens of each row's `unsafe_completion` (mean over its tokens; "
            "rows without one count 0; mean over the rows of the batch), plus the banned-token term when "
            "`banned_strings` is set. 0 gives exactly TRL's SFT loss."
        },
    )
    banned_strings: list[str] | None = field(
        default=None,
        metadata={
            "help": "Optional strings the model should never start (e.g. 'Sure, here is'). Adds to the penalty, per "
            "row, the mean over completion positions of -log(1 - mass), mass = total probability of the first tokens "
            "of these strings (tokenized at the start of a text and after a space). Needs one extra forward pass "
            "with full logits per step. Default None (off)."
        },
    )

    def __post_init__(self):
        if not self.safety_penalty_weight >= 0:
            raise ValueError(f"safety_penalty_weight={self.safety_penalty_weight!r}; expected a float >= 0")
        if self.banned_strings is not None and (
            not self.banned_strings or not all(isinstance(s, str) and s.strip() for s in self.banned_strings)
        ):
            raise ValueError(f"banned_strings={self.banned_strings!r}; expected None or a list of non-empty strings")
        super().__post_init__()


def banned_first_token_ids(tokenizer: Any, banned_strings: Sequence[str]) -> list[int]:
    """First token ids of each banned string, tokenized at the start of a text and after a space (sorted, unique).

    Raises:
        ValueError: a string that tokenizes to nothing.
    """
    ids = set()
    for text in banned_strings:
        for variant in (text, " " + text.lstrip()):
            tokens = tokenizer(variant, add_special_tokens=False)["input_ids"]
            if not tokens:
                raise ValueError(f"banned string {text!r} tokenizes to no tokens")
            ids.add(tokens[0])
    return sorted(ids)


@dataclass
class DataCollatorWithUnsafeCompletions:
    """Wraps TRL's SFT collator and adds the rows' unsafe sequences, right-padded, as a separate small batch.

    The wrapped collator sees the examples without the unsafe keys, so its output is exactly TRL's. When at least
    one example has an unsafe sequence (`unsafe_input_ids`, `unsafe_labels`: prompt + unsafe response, labels -100 on
    the prompt), the batch also holds `unsafe_input_ids`, `unsafe_attention_mask`, `unsafe_labels` (U, T') for the U
    rows that have one, and `unsafe_num_rows` (the batch's row count B, the denominator of the penalty's mean).
    When the examples come from a dataset with unsafe responses but none of them has one, the sub-batch is one
    placeholder row (the pad token, label -100: no penalized token, penalty exactly 0), so that every batch of such
    a dataset, on every process, runs the same unlikelihood forward.
    """

    collator: Callable[[list[dict[str, Any]]], dict[str, Any]]
    pad_token_id: int

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator([{k: v for k, v in ex.items() if k not in _UNSAFE_ROW_KEYS} for ex in examples])
        if not any("unsafe_input_ids" in ex for ex in examples):
            return batch
        unsafe = [ex for ex in examples if ex.get("unsafe_input_ids") is not None and len(ex["unsafe_input_ids"]) > 0]
        if not unsafe:
            unsafe = [{"unsafe_input_ids": [self.pad_token_id], "unsafe_labels": [-100]}]
        length = max(len(ex["unsafe_input_ids"]) for ex in unsafe)
        ids = torch.full((len(unsafe), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(unsafe), length), -100, dtype=torch.long)
        mask = torch.zeros((len(unsafe), length), dtype=torch.long)
        for i, ex in enumerate(unsafe):
            n = len(ex["unsafe_input_ids"])
            ids[i, :n] = torch.as_tensor(ex["unsafe_input_ids"])
            labels[i, :n] = torch.as_tensor(ex["unsafe_labels"])
            mask[i, :n] = 1
        batch.update(
            unsafe_input_ids=ids,
            unsafe_attention_mask=mask,
            unsafe_labels=labels,
            unsafe_num_rows=torch.tensor(len(examples)),
        )
        return batch


class SFTTrainer(TrainerMixin, trl.SFTTrainer):
    """`trl.SFTTrainer` with loss = TRL's completion-only CE + `safety_penalty_weight` x safety penalty.

    Takes everything `trl.SFTTrainer` takes. Datasets may carry an `unsafe_completion` column (see
    `trl_ext.data.instructions.make_instruction_dataset`); its responses are tokenized after their row's prompt
    (prompt rendered as TRL renders it, the response tokenized on its own without EOS) and penalized by unlikelihood.
    Packing (`packing=True`, TRL's padding-free best-fit packing: position ids restart per document, so attention
    and labels never cross documents) is supported for the CE; it merges rows, so it cannot carry the per-row unsafe
    responses and is refused when they would be penalized.

    `args` is a `trl_ext.SFTConfig`, or a `trl.SFTConfig` or plain `transformers.TrainingArguments` (converted as
    upstream converts the latter: every field copied with its value; the fields it lacks keep their defaults). Each
    checkpoint also holds the running token count behind `num_tokens`.

    Raises:
        ValueError: packing with an `unsafe_completion` column and a positive `safety_penalty_weight`; a banned
        string that tokenizes to nothing; and whatever `trl.SFTTrainer` raises. RuntimeError: the installed TRL is
        untested or lacks a seam this trainer overrides (`trl_ext.trainers.upstream`).
    """

    _tag_names = ["trl", "sft", "trl_ext"]

    def __init__(self, model: Any, args: trl.SFTConfig | None = None, *pos_args: Any, **kwargs: Any):
        check_upstream(trl.SFTTrainer, _SEAMS)
        args = opening_args(SFTConfig, model, args, "SFT")
        super().__init__(model, args, *pos_args, **kwargs)
        self.data_collator = DataCollatorWithUnsafeCompletions(self.data_collator, self._tokenizer.pad_token_id)
        self._banned_token_ids = (
            banned_first_token_ids(self._tokenizer, args.banned_strings) if args.banned_strings else None
        )

    # ----- data: tokenize the unsafe responses next to their prompts, then let TRL prepare the rest -----

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        # One BOS: TRL tokenizes plain-text prompts/documents with special tokens; a string already rendered with a
        # template that writes BOS would get a second one (trl_ext.data.strip_leading_bos).
        dataset = strip_leading_bos_columns(dataset, processing_class, ("prompt", args.dataset_text_field))
        columns = dataset.column_names or []
        if args.completion_only_loss is None and "completion_mask" in columns and not self.completion_only_loss:
            # Upstream's None only looks for prompt/completion columns; a pre-tokenized completion_mask is the same
            # split, so its prompt tokens stay untrained (upstream builds the labels from it in _prepare_dataset).
            self.completion_only_loss = True
            try:
                return self._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
            finally:
                self.completion_only_loss = False
        if UNSAFE_COMPLETION_COLUMN in columns:
            if packing and args.safety_penalty_weight > 0:
                raise ValueError(
                    f"The {dataset_name} dataset has an {UNSAFE_COMPLETION_COLUMN!r} column and "
                    f"safety_penalty_weight={args.safety_penalty_weight}, but packing merges rows and cannot carry "
                    "per-row unsafe responses. Set packing=False, or drop the column (or set the weight to 0) to "
                    "train the CE alone with packing."
                )
            if "prompt" not in columns:
                raise ValueError(
                    f"The {dataset_name} dataset has an {UNSAFE_COMPLETION_COLUMN!r} column but no 'prompt' column; "
                    "unsafe responses need the prompt they answer (use the prompt-completion format)."
                )
            dataset = dataset.map(
                self._tokenize_unsafe,
                fn_kwargs={"max_length": args.max_length},
                remove_columns=[UNSAFE_COMPLETION_COLUMN],
                **(
                    {"desc": f"Tokenizing unsafe completions of {dataset_name} dataset"}
                    if isinstance(dataset, Dataset)
                    else {}
                ),
            )
        return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)

    def _tokenize_unsafe(self, example: dict[str, Any], max_length: int | None) -> dict[str, list[int]]:
        unsafe = example[UNSAFE_COMPLETION_COLUMN]
        if not unsafe:
            return {"unsafe_input_ids": [], "unsafe_labels": []}
        if not isinstance(unsafe, str):
            raise ValueError(
                f"{UNSAFE_COMPLETION_COLUMN} must be a string or None, got {type(unsafe).__name__}: {unsafe!r}"
            )
        tokenizer = self._tokenizer
        if is_conversational(example):
            prompt_ids = tokenizer.apply_chat_template(
                example["prompt"],
                tokenize=True,
                return_dict=True,
                add_generation_prompt=True,
                chat_template=self.chat_template,
            )["input_ids"]
        else:
            prompt_ids = tokenizer(text=example["prompt"])["input_ids"]
        unsafe_ids = tokenizer(unsafe, add_special_tokens=False)["input_ids"]
        input_ids, labels = prompt_ids + unsafe_ids, [-100] * len(prompt_ids) + unsafe_ids
        if max_length is not None:
            input_ids, labels = input_ids[:max_length], labels[:max_length]
        return {"unsafe_input_ids": input_ids, "unsafe_labels": labels}

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *_UNSAFE_ROW_KEYS]))

    # ----- loss -----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Mirrors trl 1.16.0 `SFTTrainer.compute_loss`, which computes the completion-only CE and logs entropy,
        # mean_token_accuracy and num_tokens; we add safety_penalty_weight * penalty. With `num_items_in_batch`,
        # Trainer does not divide the loss by the gradient-accumulation steps (the CE is already a share of the
        # accumulated token count), so the penalty, a per-micro-batch mean, is divided by them here, as upstream
        # does for its MoE aux loss.
        mode = "train" if self.model.training else "eval"
        unsafe = {key: inputs.pop(key) for key in _UNSAFE_BATCH_KEYS if key in inputs}
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        ce, outputs = result if return_outputs else (result, None)
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        # Means over the processes, as Trainer logs `loss` (a per-rank value would break loss = ce + w * penalty).
        gather = self.accelerator.gather
        self._metrics[mode]["ce_loss"].append(gather(ce.detach()).mean().item() * steps)

        weight = self.args.safety_penalty_weight
        loss = ce
        if weight > 0 or mode == "eval":
            parts = {"unlikelihood": self._unlikelihood_penalty(model, unsafe, ce)}
            if self._banned_token_ids is not None:
                parts["banned_tokens"] = self._banned_token_penalty(model, inputs)
            penalty = sum(parts.values())
            loss = ce + weight * penalty / steps
            self._metrics[mode]["safety_penalty"].append(gather(penalty.detach()).mean().item())
            if len(parts) > 1:
                for name, value in parts.items():
                    self._metrics[mode][f"safety_penalty/{name}"].append(gather(value.detach()).mean().item())
        return (loss, outputs) if return_outputs else loss

    def _unlikelihood_penalty(self, model, unsafe: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Mean over the batch's rows of each row's unlikelihood term (0 for rows without an unsafe response)."""
        if not unsafe:
            return like.new_zeros(())
        outputs = model(
            input_ids=unsafe["unsafe_input_ids"],
            attention_mask=unsafe["unsafe_attention_mask"],
            labels=unsafe["unsafe_labels"],
            fused_lm_head=True,
            use_cache=False,
        )
        per_row = functional.unlikelihood_loss(outputs.log_probs, outputs.label_mask)
        return per_row.sum() / unsafe["unsafe_num_rows"].clamp(min=1)

    def _banned_token_penalty(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """Mean over rows of the banned-token unlikelihood at the positions that predict completion tokens."""
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        mask = inputs["labels"][:, 1:] != -100
        return functional.banned_token_unlikelihood_loss(logits[:, :-1], self._banned_token_ids, mask).mean()
