"""``trl_ext.GRPOConfig``: ``trl.GRPOConfig`` plus the course's choices, and the GRPO grouping rule the recipes check.

Re-exported by ``trl_ext.trainers.grpo.trainer`` (old pickled ``training_args.bin`` still load). TRL's names for the
course fields are resolved in trl_ext/objective/trl_names.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import trl
from transformers import TrainingArguments

from trl_ext import functional
from trl_ext.objective import trl_names
from trl_ext.objective.advantages import ADVANTAGE_ESTIMATORS
from trl_ext.objective.aggregations import AGGREGATIONS
from trl_ext.objective.losses import POLICY_LOSSES
from trl_ext.objective.trl_names import Derived
from trl_ext.registry import LiveText
from trl_ext.stop_strings import check_stop_strings
from trl_ext.trainers.grpo import vllm as vllm_engine
from trl_ext.trainers.upstream import config_from_upstream


def generation_grouping_problem(values: Mapping[str, Any], processes: int = 1) -> str | None:
    """Why ``num_generations`` does not divide the completions generated per step, in the flags that set them; or None.

    ``trl.GRPOConfig.__post_init__``'s rule (TRL 1.16; checked in ``tests/test_upstream_seams.py``):
    ``generation_batch_size`` (given, or ``per_device_train_batch_size`` x processes x ``steps_per_generation``) must be
    a multiple of ``num_generations``.

    Args:
        values: option name -> value; needs ``num_generations`` and ``per_device_train_batch_size``.
        processes: the number of training processes (``WORLD_SIZE``)."""
    per_step = values["per_device_train_batch_size"] * processes
    steps = values.get("steps_per_generation") or values.get("gradient_accumulation_steps") or 1
    if values.get("generation_batch_size"):
        total, how = values["generation_batch_size"], f"--generation_batch_size {values['generation_batch_size']}"
    else:
        total = per_step * steps
        which = "--steps_per_generation" if values.get("steps_per_generation") else "--gradient_accumulation_steps"
        batch = values["per_device_train_batch_size"]
        how = f"--per_device_train_batch_size {batch} x {processes} process(es) x {which} {steps}"
    if total % values["num_generations"] == 0:
        return None
    return (
        f"--num_generations {values['num_generations']} must divide the completions generated per step, {total} = "
        f"{how}; change --num_generations or --per_device_train_batch_size"
    )


def _upstream_loss_types_help() -> str:
    return ", ".join(
        f"{name!r} -> {' with '.join(repr(value) for value in meaning.values())}"
        for name, meaning in trl_names.upstream_objectives().items()
    )


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """``trl.GRPOConfig`` plus the course's choices (CS336 A5, sections 7.2-7.3).

    The objective is four registered choices: ``pg_loss_type`` (``trl_ext.objective.losses``),
    ``length_normalization`` (``trl_ext.objective.aggregations``), ``advantage_estimator``
    (``trl_ext.objective.advantages``) and ``normalize_by_std``. TRL's ``loss_type``, ``scale_rewards`` and
    ``multi_objective_aggregation`` are other names for them (``trl_names``); give either, the other is derived in
    ``__post_init__``, both given must agree. ``epsilon`` is the GRPO-Clip ``cliprange`` (``epsilon_high``,
    ``delta``, ``importance_sampling_level``: TRL's variants, off by default); ``beta`` the KL weight."""

    pg_loss_type: str | None = field(
        default=None,
        metadata={
            "help": POLICY_LOSSES.live_help(
                "Per-token policy-gradient loss (trl_ext.objective.losses.POLICY_LOSSES): ",
                ", or package.module:fn, your own function (log_probs, old_log_probs, advantages, response_mask, "
                "config) -> (per_token_loss, metrics) (on-policy only, every row's backward run) or a "
                "trl_ext.objective.losses.PolicyLoss. Unset (None, the default): what TRL's loss_type says when it "
                "names a "
                "per-token objective (cispo, sapo, vespo), else 'grpo_clip'; after construction it holds the value "
                "in use. A loss that ignores the old log-probs is on-policy only: with it "
                "num_iterations must be 1 and steps_per_generation must not exceed gradient_accumulation_steps.",
            )
        },
    )
    advantage_estimator: str | None = field(
        default=None,
        metadata={
            "help": ADVANTAGE_ESTIMATORS.live_help(
                "How the rewards of a batch become each rollout's advantage (trl_ext.objective.advantages."
                "ADVANTAGE_ESTIMATORS): ",
                ", or package.module:fn, your own function (rewards_per_func (N, K), reward_weights (K,), "
                "group_size, config) -> (N,) advantages. Unset (None, the default): what TRL's scale_rewards='batch' "
                "(batch_std) or multi_objective_aggregation='normalize_then_sum' says when given, else the estimator "
                "the pg_loss_type is defined with ('raw_rewards' for 'no_baseline'), else 'group_normalized'; "
                "another one given with such a loss raises. After construction it holds the value in use.",
            )
        },
    )
    advantage_eps: float = field(
        default=1e-6,
        metadata={
            "help": "Added to the std before dividing, in every built-in estimator that divides (default 1e-6, the "
            "handout's, whichever name chose the estimator). TRL hard-codes 1e-4: GRPOTrainer given a trl.GRPOConfig "
            "(GRPOConfig.from_upstream) sets 1e-4. >= 0."
        },
    )
    normalize_by_std: bool | None = field(
        default=None,
        metadata={
            "help": "Divide the group-centred reward by the group's unbiased std + advantage_eps (True, GRPO) or keep "
            "only the mean baseline (False, Dr. GRPO); read by 'group_normalized' (batch_std and normalize_then_sum "
            "always divide: False conflicts with them). Unset (None, the default): what TRL's scale_rewards says "
            "when it is given ('group'/True -> True, 'none'/False -> False), else True. After construction it holds "
            "the value in use."
        },
    )
    length_normalization: str | None = field(
        default=None,
        metadata={
            "help": LiveText(
                lambda: (
                    "How the per-token losses of a batch become one loss "
                    "(trl_ext.objective.aggregations.AGGREGATIONS): "
                    + AGGREGATIONS.help().replace("%", "%%")
                    + ", or package.module:fn, your own function (per_token_loss, response_mask, normalize_constant, "
                    "empty_rows) -> loss. Unset (None, the default): what TRL's loss_type says when it is given, else "
                    "the one the pg_loss_type is defined with ('token_mean' for cispo and vespo), else 'masked_mean'. "
                    "After construction it holds the value in use."
                )
            )
        },
    )
    kl_estimator: str = field(
        default="k3",
        metadata={
            "help": "Per-token KL(pi || pi_ref) estimator used when beta > 0: 'k1', 'k2' or 'k3' (default; Schulman "
            "2020, the one TRL uses). With a PEFT model and no ref_model, TRL's reference is the adapter as it was "
            "when training started: the base model with the adapter disabled for a new adapter, a frozen copy (named "
            "'ref') of the starting adapter when training continues a trained one."
        },
    )
    kl_target: float | None = field(
        default=None,
        metadata={
            "help": "Target KL for the adaptive KL coefficient (Ziegler et al. 2019). None (default) keeps beta fixed. "
            "When set, beta (> 0 required, the starting value) is updated once per batch of new samples (once per "
            "generation, however many optimizer steps num_iterations and steps_per_generation make of it; applied from "
            "the optimizer step after the one that finishes the batch) and logged as 'beta' at every optimizer step. "
            "The measured KL is the per-token mean of the kl_estimator over the "
            "completion tokens of that batch, taken the first time each sample is trained on: a target from a paper "
            "that sums the KL over the response must be divided by the response length."
        },
    )
    kl_horizon: float = field(
        default=10000.0,
        metadata={
            "help": "Horizon of the adaptive KL controller in samples (default 10000, as in Ziegler et al.): each "
            "update changes beta by at most a factor 1 +- 0.2 * generation_batch_size / kl_horizon (samples "
            "generated per update, all processes)."
        },
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={
            "help": "Multiply the per-token KL by the importance ratio pi/pi_old (DeepSeek-V3.2). Default False: the "
            "course's plain KL estimate (TRL's default is True)."
        },
    )
    share_prompt_cache: bool = field(
        default=True,
        metadata={
            "help": "Run each distinct prompt of a batch through the model once and reuse its key/value cache for all "
            "of its completions: in transformers generation (prefill) and in the log-prob forward and backward. "
            "Same log-probs and gradients up to float rounding (causal attention: a prompt's keys and values do not "
            "depend on its completion); saves (G-1)/G of the prompt's compute for groups of G. With gradient "
            "checkpointing (TRL's default gradient_checkpointing=True, or the model's gradient_checkpointing_enable), "
            "which keeps no cache in a training forward, the log-prob forwards share each prompt without a cache "
            "instead: the distinct prompts and every completion in one padding-free sequence "
            "(trl_ext.speed.packing.forward_in_one_sequence; needs pack_completions and what packing needs), which "
            "checkpointing recomputes exactly, reentrant or not. Old, reference and training forwards always take "
            "the same path, so equal weights give bit-equal log-probs. Default True; off for vLLM generation (its own "
            "prefix caching), multimodal inputs, FSDP and DeepSpeed (every forward gathers parameters collectively, "
            "so all ranks must run the same forwards); in the log-prob forwards off with TRL's MoE load-balancing "
            "loss (it counts every row's tokens) and with top_entropy_quantile < 1 (a quantile of every token's "
            "entropy, where a last-bit rounding difference moves a token across the threshold); and wherever it "
            "cannot be exact for the model, said in one log "
            "line: decided once per model for the architecture (trl_ext.speed.shared_prompts.savings_decision: "
            "length-dependent RoPE, caches that cannot be indexed by row such as linear-attention/SSM layers, ...), "
            "at every use for dropout (also set after the trainer was built) and train/eval mode, or for a "
            "generation call (beams, cache_implementation, ...). Set False to run TRL's unshared forwards."
        },
    )
    skip_zero_advantage_rows: bool = field(
        default=True,
        metadata={
            "help": "With beta = 0, a completion whose advantage is exactly 0 (its group's rewards are all equal) "
            "adds exactly 0 to the loss and to every gradient: run its forward without gradient (its log-probs and "
            "entropy still feed the logged metrics) and skip its backward. Same loss and metrics, gradients equal up "
            "to float rounding. Works with gradient checkpointing (the rows without gradient run as a batch of their "
            "own, not checkpointed; the others are checkpointed as usual). Default True; not with FSDP or DeepSpeed "
            "(their forwards are collective), nor with TRL's MoE load-balancing loss (over every row) or entropy mask "
            "(top_entropy_quantile < 1: a quantile of every token's entropy, where the skipped rows' separate "
            "forward rounds differently and moves tokens across the threshold), nor with TRL's entropy bonus "
            "(entropy_coef != 0 or use_adaptive_entropy: such a row still has its entropy's gradient), nor where a "
            "row's outputs depend on the other rows of its batch or dropout is active (one log line says so). TRL's "
            "off-policy mask (off_policy_mask_threshold, one sequence's mean KL against a constant) keeps it on: it "
            "only zeroes policy-loss tokens."
        },
    )
    pack_completions: bool = field(
        default=True,
        metadata={
            "help": "With share_prompt_cache, run the completion forward and backward padding-free: the real tokens of "
            "every row packed into one sequence, a 4D attention mask letting each token see exactly its own prompt "
            "and its own row (trl_ext.speed.packing.packed_forward, over the prompts' cache), so the padding after a "
            "completion's end costs nothing. With gradient checkpointing the distinct prompts go into that sequence "
            "too, one forward without a cache (trl_ext.speed.packing.forward_in_one_sequence): packing is then how the "
            "log-prob forwards share prompts, and pack_completions=False runs them unshared. Rows are packed in one "
            "canonical order, so the same rows in any order give bit-equal log-probs. Same log-probs and gradients "
            "up to float rounding. Default True; on only where it is exact for the model (sdpa attention over "
            "key/value caches without sliding windows, checked by a probe against the padded forward; one log line "
            "otherwise) and not with TRL's MoE load-balancing loss or entropy mask (top_entropy_quantile < 1)."
        },
    )
    prepack_linear_weights: bool = field(
        default=True,
        metadata={
            "help": "In transformers generation on the CPU in fp32, run every nn.Linear on its weight packed once per "
            "generation batch, for the rows each generate call decodes, and dropped at the batch's end "
            "(trl_ext.speed.packed_linear; MKL's packed sgemm on Intel CPUs, oneDNN otherwise): decoding "
            "multiplies a few rows by every weight, a small GEMM that MKL runs far below the CPU's peak on a plain "
            "weight (a decode step's matmuls take 0.5-0.6x the time on the CPUs measured). Same math, outputs may "
            "differ at float rounding. Default True; off for vLLM, GPUs, FSDP and DeepSpeed, for modules that are "
            "not plain fp32 nn.Linear (quantized, LoRA wrappers keep their own forward), under autocast, and where "
            "the packed copies would take more than a quarter of the available memory, or where a probe finds "
            "PyTorch's packing ops computing something else (one log line). "
            "The log-prob forwards and backward are not affected."
        },
    )
    vllm_dtype: str = field(
        default="policy",
        metadata={
            "help": "dtype of the vLLM engine that use_vllm builds in colocate mode: 'policy' (default: the trained "
            "model's own dtype, so that rollouts come from the policy), 'auto' (vLLM's choice, TRL 1.16's behaviour: "
            "a float32 checkpoint runs in bfloat16), 'float32', 'bfloat16' or 'float16'. Server mode: the server's "
            "own --dtype (trl vllm-serve --dtype)."
        },
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "Dynamic sampling (DAPO, Yu et al. 2025): keep drawing extra generation rounds of new prompt "
            "groups until every process's generation batch holds only groups with a gradient (some rollout's weight "
            "not 0: rewards not all equal; for pg_loss_type='no_baseline', whose weights are the raw rewards, rewards "
            "not all 0), or max_sampling_rounds rounds were drawn; then missing groups are filled with "
            "the earliest groups without gradient, so shapes stay fixed. Extra prompts come from the trainer's own "
            "seeded permutation of the training set, or for a streaming datasets.IterableDataset its own seeded "
            "shuffle of the stream (position saved with each checkpoint). Logs "
            "dynamic_sampling/rounds, groups_drawn, groups_kept, groups_wanted and the trained batch's "
            "dynamic_sampling/reward, reward_std, frac_reward_zero_std (reward, reward_std, frac_reward_zero_std, "
            "completions/* and num_tokens keep upstream's meaning: over every round generated). Needs "
            "per_device_train_batch_size x steps_per_generation to be a multiple of num_generations, and a "
            "pg_loss_type whose zero weights give zero gradients (all built-in ones). It only chooses which groups a "
            "batch trains on, so it stays valid with TRL's entropy bonus (the groups it fills in then train their "
            "entropy term alone). Default False (TRL's behaviour)."
        },
    )
    max_sampling_rounds: int = field(
        default=4,
        metadata={
            "help": "With dynamic_sampling: most generation rounds per generation batch, the first included "
            "(default 4; like verl's max_num_gen_batches). Each extra round costs one full generation."
        },
    )
    stop_strings: list[str] | None = field(
        default=None,
        metadata={
            "help": "Stop strings: generation (transformers and vLLM alike) ends a completion with the first of these "
            "it writes, kept in the completion, and nothing after it is rewarded or trained on (the course's vLLM "
            "stop=[...], include_stop_str_in_output=True; trl_ext.stop_strings). Unset (None, the default): the "
            "stop strings the reward functions declare (a trl_ext task's: '</answer>' for the R1-Zero format, none "
            "for chat prompts); [] for none. A stop string's last token may run past it (e.g. '>.'): that sampled "
            "token is trained, the completion's text ends at the stop string."
        },
    )
    min_completion_length: int | None = field(
        default=None,
        metadata={
            "help": "Fewest tokens a sampled completion has before it may end: EOS and stop strings are held back "
            "until more than this many tokens are out, a stop string ending in their text does not count (vLLM's "
            "min_tokens; transformers' min_new_tokens plus the same stop check). Unset (None, the default): 4 when "
            "stop strings are set (the handout's sampling_min_tokens = 4), else 0 (TRL's default)."
        },
    )
    loss_type: str | None = field(
        default=None,
        metadata={
            "help": LiveText(
                lambda: (
                    "TRL's name for pg_loss_type and length_normalization, with TRL's meaning: "
                    + _upstream_loss_types_help()
                    + " (a loss type that names only a length normalization keeps the pg_loss_type, 'grpo_clip' "
                    "unless given). Give this or the course names (both: they must agree). Unset (None, the "
                    "default): derived from them (None where TRL has no name for the pair)."
                )
            )
        },
    )
    scale_rewards: str | None = field(
        default=None,
        metadata={
            "help": "TRL's name for normalize_by_std and advantage_estimator, with TRL's meaning: 'group' or True "
            "(= normalize_by_std=True), 'none' or False (= normalize_by_std=False), 'batch' (= advantage_estimator="
            "'batch_std': the group mean over the whole batch's std). Give this or the course names (both: they must "
            "agree). Unset (None, the default): derived from them."
        },
    )
    multi_objective_aggregation: str | None = field(
        default=None,
        metadata={
            "help": "TRL's name for advantage_estimator='normalize_then_sum' (GDPO: each reward function normalized "
            "per group, weighted sum, normalized over the batch): 'normalize_then_sum' means it, "
            "'sum_then_normalize' (TRL's default) any other estimator. Give this or advantage_estimator (both: "
            "they must agree). Unset (None, the default): derived from advantage_estimator."
        },
    )

    # TRL's name -> the course fields its values may decide (trl_ext.objective.trl_names). A recipe's command line
    # that sets one of them overrides what its config files say of those fields (trl_ext.cli.parse).
    UPSTREAM_OPTIONS: ClassVar[dict[str, tuple[str, ...]]] = trl_names.UPSTREAM_OPTIONS

    @staticmethod
    def upstream_meaning(name: str, value: Any) -> dict[str, Any] | None:
        """The course fields TRL's option ``name`` set to ``value`` decides (``trl_names.upstream_meaning``)."""
        return trl_names.upstream_meaning(name, value)

    def __post_init__(self):
        loss = trl_names.resolve_objective(self)
        trl_names.resolve_advantages(self, loss)
        functional.check_choice("kl_estimator", self.kl_estimator, functional.KL_ESTIMATORS)
        functional.check_choice(
            "importance_sampling_level", self.importance_sampling_level, functional.IMPORTANCE_SAMPLING_LEVELS
        )
        if self.vllm_dtype is not None:  # None: the policy's dtype
            functional.check_choice("vllm_dtype", self.vllm_dtype, vllm_engine.VLLM_DTYPES)
        if self.advantage_eps < 0:
            raise ValueError(f"advantage_eps={self.advantage_eps}; expected a float >= 0")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise ValueError(f"epsilon_high={self.epsilon_high}; expected a float >= 0 (or None: epsilon)")
        if self.delta is not None and not self.delta > 0:
            raise ValueError(f"delta={self.delta}; expected a float > 0 (or None: no two-sided clipping)")
        if loss.takes_sampling_ratio and self.use_vllm and self.vllm_importance_sampling_correction:
            if self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):  # trl.GRPOTrainer's check
                raise ValueError(
                    f"{'VESPO' if loss.name == 'vespo' else repr(loss.name)} loss requires "
                    "`vllm_importance_sampling_mode` to be either 'token_truncate' or 'token_mask'. Got: "
                    f"{self.vllm_importance_sampling_mode}."
                )
        if self.stop_strings is not None:
            self.stop_strings = list(check_stop_strings(self.stop_strings))
        if self.min_completion_length is not None and self.min_completion_length < 0:
            raise ValueError(f"min_completion_length={self.min_completion_length}; expected an integer >= 0")
        if self.kl_target is not None and not (self.beta > 0 and self.kl_target > 0 and self.kl_horizon > 0):
            raise ValueError(
                f"kl_target={self.kl_target} needs beta > 0 (the starting coefficient), kl_target > 0 and "
                f"kl_horizon > 0; got beta={self.beta}, kl_horizon={self.kl_horizon}"
            )
        super().__post_init__()
        reused = self.num_iterations > 1 or self.steps_per_generation > self.gradient_accumulation_steps
        if not loss.uses_old_log_probs and reused:
            raise ValueError(
                f"pg_loss_type={self.pg_loss_type!r} is an on-policy loss (it ignores the old log-probs), but "
                f"num_iterations={self.num_iterations} and steps_per_generation={self.steps_per_generation} (> "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}?) train on samples from an older "
                "policy. Set num_iterations=1 and steps_per_generation=gradient_accumulation_steps, or use an "
                "off-policy-corrected loss such as pg_loss_type='grpo_clip'."
            )
        if self.dynamic_sampling and not loss.zero_advantage_zero_gradient:
            raise ValueError(
                f"dynamic_sampling=True needs a loss whose rollouts of weight 0 have no gradient, and "
                f"pg_loss_type={self.pg_loss_type!r} does not declare it (zero_advantage_zero_gradient of its "
                "trl_ext.objective.losses.PolicyLoss): every group may carry a gradient, so none can be dropped"
            )
        if self.dynamic_sampling and ADVANTAGE_ESTIMATORS.get(self.advantage_estimator).spans_groups:
            raise ValueError(
                f"dynamic_sampling=True with advantage_estimator={self.advantage_estimator!r}: its advantages take "
                "statistics of the whole generation batch, and dynamic sampling assembles a batch from the groups "
                "of several generation rounds, each with its own statistics; use 'group_normalized' (scale_rewards "
                "'group' or 'none') or turn dynamic_sampling off"
            )

    def to_dict(self) -> dict[str, Any]:
        # derived option values as plain strings, for serializers that check exact types (yaml.safe_dump)
        return {k: str(v) if isinstance(v, Derived) else v for k, v in super().to_dict().items()}

    @classmethod
    def from_upstream(cls, args: trl.GRPOConfig | TrainingArguments) -> GRPOConfig:
        """The ``trl_ext.GRPOConfig`` equivalent to a ``trl.GRPOConfig`` or ``TrainingArguments``, every field copied.

        TRL's ``loss_type``, ``scale_rewards`` and ``multi_objective_aggregation`` keep their meaning (``trl_names``).
        ``advantage_eps`` is TRL's 1e-4 for a ``trl.GRPOConfig``, the course's 1e-6 for plain ``TrainingArguments``.

        Raises:
            ValueError: values out of range or contradicting names, and whatever ``__post_init__`` rejects."""
        # generation_batch_size: derived from steps_per_generation by upstream's __post_init__, derived again here
        upstream_eps = {"advantage_eps": 1e-4} if isinstance(args, trl.GRPOConfig) else {}
        return config_from_upstream(cls, args, generation_batch_size=None, **upstream_eps)
