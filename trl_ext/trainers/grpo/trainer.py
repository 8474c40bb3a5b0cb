"""GRPO with the course's advantages, loss and KL, everything else from ``trl.GRPOTrainer``.

``GRPOTrainer`` overrides these upstream methods (TRL 1.16), and no others:

- ``__init__``: converts the config (``GRPOConfig.from_upstream``), checks the seams (``check_upstream``);
- ``_calculate_rewards``: passes ``completion_truncated`` to the reward functions, keeps every process's rewards;
- ``_generate_and_score_completions`` (``DynamicSamplingMixin``, dynamic_sampling.py): upstream's advantages replaced by
  the ``advantage_estimator``'s (``trl_ext.objective.advantages``); with ``dynamic_sampling``, several rounds until the
  batch holds groups with a gradient;
- ``_tokenize_prompts``: drops a doubled BOS of a prompt rendered with a BOS-writing template;
- ``_compute_loss``: the ``pg_loss_type`` entry's per-token loss (``trl_ext.objective.losses.policy_loss``) plus
  ``functional.compute_kl``, reduced by the ``length_normalization`` entry (``trl_ext.objective.aggregations``), with
  TRL's entropy mask, off-policy mask and entropy bonus around it (``GRPOLossTermsMixin``, terms.py);
- ``_generate_single_turn`` and ``_generate``: stop strings (``trl_ext.stop_strings``); a completion that ended neither
  at EOS nor at a stop string counts as cut by the length limit;
- ``log``: one warning when most completions of a logging window were cut;
- ``training_step``: updates the adaptive KL coefficient (``kl_target``);
- ``TrainerMixin``'s checkpoint-state hooks (upstream.py), so a resumed run is bit-exact.

It adds ``sample(prompts)`` (rollouts through upstream's ``_generate``, e.g. for expert iteration). The speed paths are
``trl_ext.trainers.grpo.speed.GRPOSpeedMixin`` (``_get_per_token_logps_and_entropies``, the generation block,
zero-advantage row skipping). ``GRPOConfig`` lives in config.py and stays importable from here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from contextlib import nullcontext
from typing import Any

import torch
import trl
from transformers import StoppingCriteriaList
from trl.trainer.utils import nanmax, nanmin

from trl_ext import functional, machine
from trl_ext.data.prompts import strip_leading_bos
from trl_ext.logs import say_once
from trl_ext.objective.advantages import ADVANTAGE_ESTIMATORS, weighted_rewards
from trl_ext.objective.aggregations import AGGREGATIONS, compute_grpo_loss
from trl_ext.objective.losses import policy_loss
from trl_ext.objective.trl_names import Derived  # noqa: F401
from trl_ext.rewards.adapters import TRUNCATION_KEYWORD
from trl_ext.stop_strings import (
    DEFAULT_MIN_TOKENS_WITH_STOP,
    StopAtStrings,
    check_stop_strings,
    cut_at_stop,
    ends_truncated,
)
from trl_ext.trainers.grpo import vllm as vllm_engine

# importable here too: configs pickled in checkpoints (training_args.bin) while they lived in this module
from trl_ext.trainers.grpo.config import GRPOConfig, generation_grouping_problem  # noqa: F401
from trl_ext.trainers.grpo.dynamic_sampling import DynamicSamplingMixin, DynamicSamplingState
from trl_ext.trainers.grpo.speed import FORWARD_KEYS, GRPOSpeedMixin, shadowing_generate
from trl_ext.trainers.grpo.terms import GRPOLossTermsMixin
from trl_ext.trainers.upstream import TRAINER_MIXIN_SEAMS, TrainerMixin, check_upstream

logger = logging.getLogger("trl_ext")

# Upstream methods trl_ext.GRPOTrainer overrides or calls: name -> parameters after self (TRL 1.16.0).
_SEAMS = {
    "__init__": (
        "model",
        "reward_funcs",
        "args",
        "train_dataset",
        "eval_dataset",
        "processing_class",
        "reward_processing_classes",
        "callbacks",
        "optimizers",
        "quantization_config",
        "peft_config",
        "tools",
        "rollout_func",
        "environment_factory",
    ),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    "_generate_and_score_completions": ("inputs",),
    "_compute_loss": ("model", "inputs"),
    # upstream's masks around the loss, called by GRPOLossTermsMixin (trl_ext/trainers/grpo/terms.py)
    "get_high_entropy_mask": ("entropies", "mask", "threshold"),
    "get_off_policy_mask": (
        "advantages",
        "per_token_logps",
        "sampling_per_token_logps",
        "mask",
        "off_policy_threshold",
    ),
    "_tokenize_prompts": ("prompts",),
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
        *FORWARD_KEYS,
    ),
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
    "_prepare_inputs": ("generation_batch",),  # regenerates when _step % (steps_per_generation * num_iterations) == 0
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "_generate": ("prompts",),  # decodes completions (cut at stop strings here); also called by sample()
    "log": ("logs", "start_time"),  # averages the window's metrics (warns once when most completions were cut)
    **TRAINER_MIXIN_SEAMS,
}


class GRPOTrainer(DynamicSamplingMixin, GRPOSpeedMixin, GRPOLossTermsMixin, TrainerMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose advantages, policy loss and KL are the course's (``trl_ext.functional``).

    Takes ``trl.GRPOTrainer``'s arguments; ``args`` is a ``trl_ext.GRPOConfig`` or a ``trl.GRPOConfig`` /
    ``TrainingArguments`` (converted by ``GRPOConfig.from_upstream``). Rewards from any source (functions, reward
    models, environments) become the course's advantages. Metrics keep TRL's names and add ``beta`` when it adapts.
    Checkpoints also hold beta, the KL window, the micro-batch counter and the buffered rollout.

    Raises:
        TypeError: ``args`` is not a ``TrainingArguments``.
        ValueError: see ``GRPOConfig.from_upstream``, and whatever ``trl.GRPOTrainer`` raises.
        ImportError, RuntimeError: ``use_vllm`` or ``use_liger_kernel`` without the package or a CUDA GPU; an
            untested TRL or a missing seam (``trl_ext.trainers.upstream``)."""

    has_rank_state = True

    def __init__(
        self, model: Any, reward_funcs: Any = None, args: trl.GRPOConfig | None = None, *pos_args: Any, **kwargs: Any
    ):
        check_upstream(trl.GRPOTrainer, _SEAMS)
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = GRPOConfig(f"{name.split('/')[-1]}-GRPO")
        elif not isinstance(args, GRPOConfig):
            args = GRPOConfig.from_upstream(args)
        vllm_need = "vllm_server" if args.vllm_mode == "server" else "vllm"
        if args.use_vllm and machine.package_available("vllm"):  # installed, but can it run here? (before any load)
            machine.require(vllm_need, f"use_vllm=True, vllm_mode={args.vllm_mode!r}", "pass `use_vllm=False`")
        # Upstream checks its options first and imports vLLM last; a missing engine is reported after those checks.
        engine = (
            vllm_engine.engine_options(lambda: vllm_engine.engine_dtype(args.vllm_dtype, self.model), args.seed)
            if args.use_vllm and args.vllm_mode == "colocate"
            else contextlib.nullcontext()
        )
        try:
            with engine:
                super().__init__(model, reward_funcs, args, *pos_args, **kwargs)
        except ImportError as err:
            if args.use_vllm and "vllm" in str(err).lower():
                machine.require(vllm_need, "use_vllm=True", "pass `use_vllm=False`")
            raise
        if self.use_vllm and vllm_engine.runs_on_cpu(self.vllm_generation):
            # vLLM's CPU build packs its weights: load the policy's through vLLM's reload (trl_ext.trainers.grpo.vllm)
            generation = self.vllm_generation
            generation.sync_weights = functools.partial(vllm_engine.sync_weights_in_place, generation)
        if args.use_liger_kernel:  # upstream: only at train()
            machine.require("liger_kernel", "use_liger_kernel=True", "pass `use_liger_kernel=False`")
        if args.dynamic_sampling:
            self._check_dynamic_sampling()
        self._gathered_rewards: torch.Tensor | None = None
        self._kl_window = torch.zeros(2, dtype=torch.float64)  # [sum of per-token KL, token count] of this rollout
        self._finished_rollout_kl: list[torch.Tensor] = []  # windows of rollouts finished since the last optimizer step
        self._decide_speed_paths()
        self._set_up_stop_strings()

    # -- where a completion ends: stop strings, and completions the length limit cut -----------------------------

    def _set_up_stop_strings(self) -> None:
        """Resolve ``stop_strings`` (the config's, else the reward functions') and ``min_completion_length`` and hand
        them to vLLM's ``SamplingParams`` or transformers' ``generate`` (a ``StoppingCriteria``); one log line when
        taken from the reward functions.

        Raises:
            ValueError: stop strings with continuous batching, a ``rollout_func`` or tools, or beside
                ``generation_kwargs`` that already set stop strings or a minimum length."""
        stops = self.args.stop_strings
        declared = [tuple(getattr(f, "stop_strings", ()) or ()) for f in self.reward_funcs]
        if stops is None:
            stops = list(dict.fromkeys(s for d in declared for s in d))
            if stops:
                logger.info(f"trl_ext: completions end at {stops} (the stop strings of the reward functions' task)")
        self._stop_strings = check_stop_strings(stops)
        minimum = self.args.min_completion_length
        self._min_completion_length = (
            minimum if minimum is not None else DEFAULT_MIN_TOKENS_WITH_STOP if self._stop_strings else 0
        )
        self._completion_truncated: list[bool] | None = None  # this process's rows of the last _generate
        self._said: set = set()  # what this trainer said once (trl_ext.logs.say_once)
        if not (self._stop_strings or self._min_completion_length):
            return
        given = set(self.args.generation_kwargs or {}) & {"stop", "stop_strings", "min_tokens", "min_new_tokens"}
        if given:
            raise ValueError(
                f"generation_kwargs sets {sorted(given)} beside stop_strings={list(self._stop_strings)} / "
                f"min_completion_length={self._min_completion_length}: set them through stop_strings and "
                "min_completion_length only (they work in both generation backends and cut the completion)"
            )
        if self._stop_strings:
            unsupported = [
                name
                for name, on in (
                    ("transformers continuous batching", getattr(self, "use_transformers_continuous_batching", False)),
                    ("a rollout_func", self.rollout_func is not None),
                    ("tools", bool(self.tools)),
                )
                if on
            ]
            if unsupported:
                raise ValueError(
                    f"stop_strings={list(self._stop_strings)} with {unsupported[0]}: trl_ext does not cut those "
                    "completions; pass stop_strings=[] (or drop it)"
                )
        if self.use_vllm:
            options = {"min_tokens": self._min_completion_length}
            if self._stop_strings:
                options.update(stop=list(self._stop_strings), include_stop_str_in_output=True)
            self.vllm_generation.generation_kwargs = {**self.vllm_generation.generation_kwargs, **options}
        elif self._min_completion_length:
            # upstream builds its GenerationConfig from these, and unwrap_model_for_generation applies them
            self.generation_kwargs["min_new_tokens"] = self._min_completion_length
            self.generation_config.min_new_tokens = self._min_completion_length

    def _generate_single_turn(self, prompt_ids, images, *args, **kwargs):
        # Upstream generates inside the speed paths' block (GRPOSpeedMixin); each completion is then cut after the
        # token completing its first stop string, with its sampling log-probs; _generate decodes the cut texts.
        self._stop_cuts = None
        stopping = self._generate_stopping_at_strings() if self._stop_strings and not self.use_vllm else nullcontext()
        with stopping, self._generation_savings(rows=len(prompt_ids)):
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, images, *args, **kwargs)
        if not self._stop_strings:
            return completion_ids, logprobs
        cuts = [
            cut_at_stop(ids, self.processing_class, self._stop_strings, self._min_completion_length)
            for ids in completion_ids
        ]
        completion_ids = [list(ids)[: c.num_tokens] if c else list(ids) for ids, c in zip(completion_ids, cuts)]
        if logprobs is not None:
            logprobs = [list(lp)[: c.num_tokens] if c else lp for lp, c in zip(logprobs, cuts)]
        self._stop_cuts = cuts
        return completion_ids, logprobs

    @contextlib.contextmanager
    def _generate_stopping_at_strings(self):
        """A block in which the policy's ``generate`` stops each row at its first stop string (``StopAtStrings``,
        from ``min_completion_length`` tokens on): an instance attribute shadows the method for the block, beneath
        the speed paths' own wrapper (prompt sharing sees the call as upstream makes it)."""
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        plain = unwrapped.generate
        tokenizer, stops, minimum = self.processing_class, self._stop_strings, self._min_completion_length

        def generate(*args, **kwargs):
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
            criteria.append(StopAtStrings(tokenizer, stops, input_ids.size(1), minimum))
            return plain(*args, stopping_criteria=criteria, **kwargs)

        with shadowing_generate(unwrapped, generate):
            yield

    def _generate(self, prompts: list):
        # Upstream's rule (last token neither EOS nor pad) counts no stop-string completion as cut; the text ends at
        # the stop string, the metrics are recounted, and each row's 'cut by the length limit' kept for the rewards.
        self._stop_cuts = None
        out = list(super()._generate(prompts))
        completion_ids, completions = out[1], out[3]
        cuts = self._stop_cuts if self._stop_cuts is not None and len(self._stop_cuts) == len(completion_ids) else None
        if cuts is not None:
            out[3] = [_with_text(c, cut.text) if cut else c for c, cut in zip(completions, cuts)]
        ends = [*self.eos_token_ids, self._tokenizer.pad_token_id]
        self._completion_truncated = [
            ends_truncated(ids, ends, stopped=cuts is not None and cuts[i] is not None)
            for i, ids in enumerate(completion_ids)
        ]
        if cuts is not None and out[2] is None:  # upstream's length metrics, recounted (no tool mask)
            self._recount_length_metrics(completion_ids)
        return tuple(out)

    def _recount_length_metrics(self, completion_ids: list) -> None:
        """Replace the ``completions/clipped_ratio`` and ``*_terminated_length`` values upstream's ``_generate`` just
        appended (TRL 1.16) with the same statistics by ``self._completion_truncated`` (gathered, as upstream)."""
        device, mode = self.accelerator.device, "train" if self.model.training else "eval"
        lengths = self.accelerator.gather(torch.tensor([len(ids) for ids in completion_ids], device=device))
        cut = self.accelerator.gather(torch.tensor(self._completion_truncated, device=device))
        terminated = lengths[~cut].float() if (~cut).any() else torch.zeros(1, device=device)
        metrics = self._metrics[mode]
        for key, value in (
            ("completions/clipped_ratio", cut.float().mean()),
            ("completions/mean_terminated_length", terminated.mean()),
            ("completions/min_terminated_length", terminated.min()),
            ("completions/max_terminated_length", terminated.max()),
        ):
            if metrics.get(key):
                metrics[key][-1] = value.item()

    def log(self, logs, start_time=None):
        # One console warning per run, at the first log whose window's completions were mostly cut.
        if "cut" not in self._said and self.model.training:
            ratios = [v for v in self._metrics["train"].get("completions/clipped_ratio", []) if not math.isnan(v)]
            if ratios and sum(ratios) / len(ratios) > 0.5:
                say_once(self._cut_warning(sum(ratios) / len(ratios)), key="cut", said=self._said, log=logger)
        super().log(logs, start_time)

    def _cut_warning(self, ratio: float) -> str:
        """The warning when most completions of a logging window hit ``max_completion_length``."""
        no_credit = [
            getattr(f, "__name__", "?") for f in self.reward_funcs if getattr(f, "credit_truncated", True) is False
        ]
        consequence = (
            f"{', '.join(no_credit)} give{'s' if len(no_credit) == 1 else ''} them no reward"
            if no_credit
            else "a reward that reads the answer from the end of the response credits the last number of a cut-off "
            "sentence"
        )
        return (
            f"{ratio:.0%} of the completions generated up to step {self.state.global_step} hit "
            f"max_completion_length={self.max_completion_length} without EOS"
            + (f" or a stop string {list(self._stop_strings)}" if self._stop_strings else "")
            + f": they are cut off mid-answer and {consequence}. Raise --max_completion_length or ask for shorter "
            "answers (--instruction); completions/clipped_ratio follows it"
        )

    # -- sampling outside train() -------------------------------------------------------------------------------

    def sample(self, prompts: list) -> tuple[list[list[int]], list[list[int]], list]:
        """Sample one completion per prompt from the current policy through one call of upstream's ``_generate``: no
        scores, advantages or training step (``recipes/expert_iteration.py``).

        As in ``train()``: pass prompts repeated in consecutive groups of ``num_generations``, model in train mode. With
        vLLM the policy's weights are loaded into the engine on every call.

        Args:
            prompts: N prompts, strings or conversations.

        Returns:
            ``(prompt_ids, completion_ids, completions)``: N unpadded token-id lists each (completions up to the first
                EOS,
            at most ``max_completion_length``) and N decoded completions (strings, or assistant messages)."""
        if self.use_vllm:
            self._last_loaded_step = -1  # upstream's tag of the step whose weights vLLM holds: none, so sync first
        with self._fixed_generation_weights():
            prompt_ids, completion_ids, _, completions, *_ = self._generate(prompts)
        return prompt_ids, completion_ids, completions

    # -- state saved with each checkpoint (trl_ext.trainers.upstream.TrainerMixin) --------------------

    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            **super()._checkpoint_state(),
            "dynamic_sampling": None if self._dynamic_state is None else self._dynamic_state.as_dict(),
            "beta": self.beta,
            "kl_window": self._kl_window.tolist(),
            "step": self._step,  # upstream's micro-batch counter: where in the rollout cycle the run stopped
        }

    def _restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        super()._restore_checkpoint_state(state)
        if state.get("dynamic_sampling") is not None and self._dynamic_state is not None:
            self._dynamic_state = DynamicSamplingState.from_dict(state["dynamic_sampling"])
        # An adaptive beta goes on from the checkpoint when both runs adapt it; a fixed beta is the config's.
        if self.args.kl_target is not None and state.get("changeable_options", {}).get("kl_target", 1.0) is not None:
            self.beta = state["beta"]
        self._kl_window = torch.tensor(state["kl_window"], dtype=torch.float64)
        self._step = state["step"]

    def _checkpoint_rank_state(self) -> dict[str, Any]:
        # Upstream regenerates on resume (its _buffered_inputs is None), so a run stopped inside a rollout cycle
        # (num_iterations > 1 or steps_per_generation > gradient_accumulation_steps) would train on other samples.
        return {"buffered_inputs": self._buffered_inputs}

    def _restore_checkpoint_rank_state(self, state: dict[str, Any]) -> None:
        buffered = state["buffered_inputs"]
        device = self.accelerator.device
        self._buffered_inputs = (
            None
            if buffered is None
            else [
                {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()} for batch in buffered
            ]
        )

    # -- advantages -------------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # Each reward function is also told which completions the length limit cut (TRUNCATION_KEYWORD).
        cut = self._completion_truncated
        if cut is None or len(cut) != len(completion_ids_list):
            ends = [*self.eos_token_ids, self._tokenizer.pad_token_id]
            cut = [ends_truncated(ids, ends, stopped=False) for ids in completion_ids_list]
        inputs = [{**row, TRUNCATION_KEYWORD: flag} for row, flag in zip(inputs, cut)]
        # Upstream returns (num_processes * local_batch, num_reward_funcs), gathered; keep it for the advantages.
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gathered_rewards = rewards_per_func
        return rewards_per_func

    def _generate_and_score_round(self, inputs):
        # One round: upstream generates and scores, the config's advantage estimator replaces its advantages.
        # With stop strings, the rows _generate found cut are masked here (upstream's would mask every stopped one).
        own_mask = bool(self.mask_truncated_completions and self._stop_strings)
        if own_mask:
            self.mask_truncated_completions = False
        try:
            output = trl.GRPOTrainer._generate_and_score_completions(self, inputs)
        finally:
            if own_mask:
                self.mask_truncated_completions = True
        if own_mask:
            keep = ~torch.tensor(self._completion_truncated, device=output["completion_mask"].device)
            output["completion_mask"] = output["completion_mask"] * keep.unsqueeze(1).int()
            if output.get("tool_mask") is not None:
                output["tool_mask"] = output["tool_mask"] * keep.unsqueeze(1).int()
            loss_mask = output["completion_mask"] * (output["tool_mask"] if output.get("tool_mask") is not None else 1)
            output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        rewards_per_func = self._gathered_rewards
        train = self.model.training
        group_size = self.num_generations if train else self.num_generations_eval
        estimator = ADVANTAGE_ESTIMATORS.get(self.args.advantage_estimator)
        advantages = estimator.fn(rewards_per_func, self.reward_weights, group_size, self.args)
        advantages = advantages.to(device=rewards_per_func.device, dtype=torch.float32)
        # Weighted sum of the reward functions; NaN where every function returned None (unscorable), as upstream.
        # The weighted terms set the float rounding scale of "all rewards equal" (functional.equal_reward_groups).
        rewards, terms = weighted_rewards(rewards_per_func, self.reward_weights)
        # Upstream's frac_reward_zero_std uses isclose(std, 0); log it by the rule the advantages use.
        equal = functional.equal_reward_groups(rewards, group_size, terms)
        self._metrics["train" if train else "eval"]["frac_reward_zero_std"][-1] = equal.float().mean().item()
        local = output["completion_ids"].size(0)
        start = self.accelerator.process_index * local
        output["advantages"] = advantages[start : start + local]
        # this process's rewards and their terms, for dynamic sampling's metrics of the trained batch
        self._round_rewards = (rewards[start : start + local], terms[start : start + local])
        # Upstream logged its own advantages for the completions table: replace them with ours.
        for _ in range(min(len(advantages), len(self._logs["advantages"]))):
            self._logs["advantages"].pop()
        self._logs["advantages"].extend(advantages.tolist())
        return output

    def _tokenize_prompts(self, prompts: list):
        # trl 1.16 adds special tokens to plain-text prompts: strip a templated prompt's BOS first (as trl_ext.eval).
        if prompts and isinstance(prompts[0], str):
            prompts = [strip_leading_bos(p, self.processing_class) for p in prompts]
        return super()._tokenize_prompts(prompts)

    # -- loss ---------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        # Mirrors trl.GRPOTrainer._compute_loss (TRL 1.16) for the per-token log-probs, then applies the course loss.
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        extra_inputs = {key: inputs.get(key) for key in FORWARD_KEYS if key in inputs}
        zero_rows = self._rows_without_gradient(inputs, extra_inputs)
        if zero_rows is None:
            per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                completion_ids.size(1),
                compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled,
                **extra_inputs,
            )
        else:
            per_token_logps, entropies, aux_loss = self._logps_without_zero_rows(
                model, input_ids, attention_mask, completion_ids.size(1), zero_rows
            )
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        advantages = inputs["advantages"].unsqueeze(1)
        old_log_probs = inputs.get("old_per_token_logps")
        old_log_probs = per_token_logps.detach() if old_log_probs is None else old_log_probs
        # upstream's off-policy sequence mask and entropy mask (trl_ext/trainers/grpo/terms.py), None when both off
        loss_mask, entropy_mask = self._policy_loss_masks(
            inputs, per_token_logps, old_log_probs, entropies, mask, advantages
        )

        # the registered loss: (B, T) per-token loss and its metrics, from log-probs, advantages, mask and config,
        # with TRL's sampler-mismatch correction (vLLM) applied by policy_loss or taken by the loss (VESPO)
        sampling_ratio = inputs.get("importance_sampling_ratio") if self.use_vllm else None
        per_token_loss, loss_metrics = policy_loss(
            self.args.pg_loss_type, per_token_logps, old_log_probs, advantages, mask, self.args, sampling_ratio
        )
        if loss_mask is not None:  # before the vLLM correction and the KL term, as upstream
            per_token_loss = per_token_loss * loss_mask
        if self.beta != 0.0:
            per_token_kl = functional.compute_kl(per_token_logps, inputs["ref_per_token_logps"], self.args.kl_estimator)
            if self.args.use_bias_correction_kl:  # by the ratio at importance_sampling_level, as TRL 1.16
                per_token_kl = per_token_kl * functional.compute_importance_ratio(
                    per_token_logps, old_log_probs, mask, self.args.importance_sampling_level
                )
            per_token_loss = per_token_loss + self.beta * per_token_kl

        mode = "train" if self.model.training else "eval"
        loss = compute_grpo_loss(
            per_token_loss,
            mask,
            self.args.length_normalization,
            normalize_constant=self._normalize_constant(inputs, mode),
            empty_rows="drop",  # rows masked by mask_truncated_completions leave the mean (upstream: "zero")
        )
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        aggregated = loss  # the policy loss (and KL) of this micro-batch, logged as policy_loss with a bonus
        loss = loss / accumulation
        if self._entropy_bonus_enabled:  # upstream's entropy bonus (trl_ext/trainers/grpo/terms.py)
            loss = loss - self._entropy_bonus(entropies, mask, entropy_mask, aggregated, accumulation, mode)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        self._log_loss_metrics(
            mode, mask, entropies, advantages, loss_metrics, per_token_kl if self.beta != 0.0 else None
        )
        return loss

    def _normalize_constant(self, inputs, mode: str) -> float | torch.Tensor | None:
        """The ``length_normalization`` entry's ``divisor``: ``max_completion_length``; for ``batch_tokens`` (DAPO)
        the batch's response tokens / processes / ``steps_per_generation`` (TRL 1.16 ``dapo`` normalizer); else None."""
        divisor = AGGREGATIONS.get(self.args.length_normalization).divisor
        if divisor == "max_completion_length":
            return self.max_completion_length
        if divisor == "batch_tokens":
            tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            return tokens / self.args.steps_per_generation if mode == "train" else tokens
        return None

    def _log_loss_metrics(self, mode, mask, entropies, advantages, loss_metrics, per_token_kl):
        """Log entropy, KL and the loss entry's metrics over every process (``clipped`` as ``clip_ratio/*``,
        ``ratio`` as ``ratio/mean|min|max``, others as their token or sequence mean)."""

        # A mean/min/max over no token is NaN, which upstream's log() leaves out of the window's average
        # (upstream logs 0.0 for its masked means there, which pulls the average down).
        def global_masked_sum_count(x):
            if x.shape != mask.shape:  # (B, 1): one value per sequence
                local = torch.stack([x.float().sum(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                local = torch.stack([torch.where(mask.bool(), x.float(), 0.0).sum(), mask.sum().float()])
            return self.accelerator.reduce(local, reduction="sum")

        def global_masked_mean(x):
            total, count = global_masked_sum_count(x).tolist()
            return total / count if count > 0 else math.nan

        self._metrics[mode]["entropy"].append(global_masked_mean(entropies))
        if per_token_kl is not None:
            kl_sum_count = global_masked_sum_count(per_token_kl.detach())
            total, count = kl_sum_count.tolist()
            self._metrics[mode]["kl"].append(total / count if count > 0 else math.nan)
            if mode == "train" and self.args.kl_target is not None:
                self._update_adaptive_beta(kl_sum_count.cpu())
        if "clipped" in loss_metrics:
            clipped = loss_metrics["clipped"]
            positive = (advantages > 0).expand_as(clipped)
            self._metrics[mode]["clip_ratio/low_mean"].append(global_masked_mean(clipped & ~positive))
            self._metrics[mode]["clip_ratio/high_mean"].append(global_masked_mean(clipped & positive))
            self._metrics[mode]["clip_ratio/region_mean"].append(global_masked_mean(clipped))
            # As trl.GRPOTrainer._compute_loss (TRL 1.16): per-sequence clipped fractions, min/max over all processes
            float_mask = mask.float()

            def gathered_sequence_means(x):
                if x.shape != mask.shape:  # (B, 1): already one value per sequence
                    return self.accelerator.gather(x.float().squeeze(1))
                return self.accelerator.gather((x.float() * float_mask).sum(-1) / float_mask.sum(-1))

            self._metrics[mode]["clip_ratio/low_min"].append(
                nanmin(gathered_sequence_means(clipped & ~positive)).item()
            )
            self._metrics[mode]["clip_ratio/high_max"].append(
                nanmax(gathered_sequence_means(clipped & positive)).item()
            )
        if "ratio" in loss_metrics:  # importance ratio pi/pi_old over response tokens (1 on-policy)
            ratio = loss_metrics["ratio"]
            mean = global_masked_mean(ratio)
            self._metrics[mode]["ratio/mean"].append(mean)
            ratio = ratio.expand_as(mask)
            # a process without response tokens contributes -inf to both maxima (it has no ratio to report)
            local = torch.stack(
                [torch.where(mask.bool(), -ratio, -math.inf).max(), torch.where(mask.bool(), ratio, -math.inf).max()]
            )
            low, high = (
                self.accelerator.reduce(local, reduction="max").tolist()
                if self.accelerator.num_processes > 1
                else local.tolist()
            )
            empty = math.isnan(mean)  # no response token on any process
            self._metrics[mode]["ratio/min"].append(math.nan if empty else -low)
            self._metrics[mode]["ratio/max"].append(math.nan if empty else high)
        for name, value in loss_metrics.items():  # a loss's own metrics (TRL's cispo_clip_ratio, ...)
            if name not in ("clipped", "ratio"):
                self._metrics[mode][name].append(global_masked_mean(value.detach()))

    def _update_adaptive_beta(self, kl_sum_count: torch.Tensor) -> None:
        """Add this micro-batch's KL sum and token count to the rollout's window (first use of its samples only)."""
        if self._step % (self.args.steps_per_generation * self.num_iterations) < self.args.steps_per_generation:
            self._kl_window += kl_sum_count.double()

    def training_step(self, model, inputs, num_items_in_batch):
        # Upstream counts micro-batches in self._step; beta is updated once per finished rollout, at the next
        # optimizer step, for its generation_batch_size new samples (Ziegler et al. 2019, section 2.2).
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.kl_target is not None:
            if self._step % (self.args.steps_per_generation * self.num_iterations) == 0:
                self._finished_rollout_kl.append(self._kl_window.clone())
                self._kl_window.zero_()
            if self.accelerator.sync_gradients:
                for total, count in self._finished_rollout_kl:
                    if count.item() == 0:  # no trained token in the rollout (all masked): no KL measured, beta stays
                        continue
                    self.beta = functional.adaptive_kl_coefficient(
                        self.beta,
                        (total / count.clamp(min=1.0)).item(),
                        self.args.kl_target,
                        self.args.kl_horizon,
                        self.args.generation_batch_size,
                    )
                self._finished_rollout_kl.clear()
                self._metrics["train"]["beta"].append(self.beta)
        return loss


def _with_text(completion: Any, text: str) -> Any:
    """A decoded completion (a string, or upstream's ``[{"role": "assistant", "content": ...}]``) with its text
    replaced by ``text``."""
    if isinstance(completion, str):
        return text
    if isinstance(completion, list) and completion and isinstance(completion[-1].get("content"), str):
        return [*completion[:-1], {**completion[-1], "content": text}]
    return completion
