"""The speed paths of ``trl_ext.GRPOTrainer``, apart from its course seams: same numbers, less compute.

``GRPOSpeedMixin`` opens, for the trainer's ``_generate_single_turn``, the block ``_generation_savings``: shared prompt
prefill (``share_prompt_cache``), packed linear weights (``prepack_linear_weights``, once per generation batch) and the
vectorised sampler (``trl_ext.speed.sampling``). It overrides one upstream method:

- ``_get_per_token_logps_and_entropies``: passes generation's position ids to every forward (issue 10) and, with
  ``share_prompt_cache``, runs each distinct prompt once (``forward_with_shared_prompts``; ``pack_completions``:
  ``packed_forward``; under activation checkpointing ``forward_in_one_sequence``);

and adds ``_rows_without_gradient`` / ``_logps_without_zero_rows`` (``skip_zero_advantage_rows``),
``_padded_forward_reason`` (options that need upstream's padded log-prob forwards: TRL's MoE load-balancing loss and
its entropy mask) and ``_savings_now`` (each saving only where exact: ``savings_decision``, ``training_noise``).
Effect: docs/performance.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from trl_ext.objective.losses import POLICY_LOSSES
from trl_ext.speed.packed_linear import PackedLinearWeights
from trl_ext.speed.packing import forward_in_one_sequence
from trl_ext.speed.sampling import same_draws_multinomial
from trl_ext.speed.shared_prompts import (
    SavingsDecision,
    accepts_position_ids,
    activation_checkpointing,
    announce,
    cache_argument,
    forward_with_shared_prompts,
    generate_with_shared_prompts,
    position_ids_from_attention_mask,
    savings_decision,
    training_noise,
)

logger = logging.getLogger("trl_ext")

# Model-input keys upstream passes to _get_per_token_logps_and_entropies (multimodal extras), TRL 1.16.
FORWARD_KEYS = (
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


def _entropy_bonus_option(args) -> str | None:
    """The option that turns TRL's entropy bonus on (``entropy_coef`` != 0 or ``use_adaptive_entropy``), as
    ``name=value``; None when the bonus is off (TRL 1.16 ``GRPOTrainer._entropy_bonus_enabled``)."""
    if getattr(args, "use_adaptive_entropy", False):
        return "use_adaptive_entropy=True"
    if getattr(args, "entropy_coef", 0.0) != 0.0:
        return f"entropy_coef={args.entropy_coef!r}"
    return None


@contextlib.contextmanager
def shadowing_generate(model: Any, generate: Callable):
    """A block in which ``model.generate`` is ``generate`` (an instance attribute shadowing the method, or the
    instance attribute already there), restored at its end."""
    own = model.__dict__.get("generate")
    model.generate = generate
    try:
        yield
    finally:
        if own is None:
            del model.generate
        else:
            model.generate = own


class GRPOSpeedMixin:
    """Prompt-cache sharing and zero-advantage row skipping for ``trl_ext.GRPOTrainer`` (see the module docstring)."""

    def _decide_speed_paths(self) -> None:
        """Note which savings the config asks for (and parameter sharding allows), and announce at construction
        those the model rules out. Whether each is on is asked again at every use (``_savings_now``)."""
        # Parameter-sharding setups gather parameters in every forward, collectively: all ranks must run the same
        # forwards, which data-dependent sharing or skipping would break.
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled
        share = self.args.share_prompt_cache and not sharded
        self._speed_requested = (
            share,
            self.args.skip_zero_advantage_rows and not sharded,
            share and self.args.pack_completions,
        )
        # TRL's gradient_checkpointing (Trainer.train turns it on), or the model's own (gradient_checkpointing_enable
        # before the trainer was built): the log-prob forwards take the cache-free path from the start
        self._checkpointing_seen = bool(self.args.gradient_checkpointing) or activation_checkpointing(self.model)
        self._savings_now(training=True)  # announce now what the training forward rules out
        # packed linear weights for transformers generation on the CPU, packed once per generation batch for the rows
        # each generate call decodes (trl_ext.speed.packed_linear)
        self._packed_linear = (
            PackedLinearWeights()
            if getattr(self.args, "prepack_linear_weights", False) and not sharded and not self.use_vllm
            else None
        )
        if self.use_vllm:
            logger.warning(
                "trl_ext generation savings off with use_vllm: vLLM generates (its own kernels, prefix cache and "
                "sampler), so share_prompt_cache's shared prefill, prepack_linear_weights and the vectorised sampler "
                "(transformers generation only) do not run; the log-prob forward and backward keep share_prompt_cache, "
                "pack_completions and skip_zero_advantage_rows where they are exact"
            )

    def _checkpointing(self) -> bool:
        """Whether the policy's training forward is activation-checkpointed: ``gradient_checkpointing`` in the
        config, or checkpointing found on the model now or at an earlier call (transformers'
        ``gradient_checkpointing_enable``). Once seen it stays: TRL turns checkpointing off around the old and
        reference log-prob forwards (``disable_gradient_checkpointing``), which must still take the training
        forward's path, so that log-probs of equal weights stay bit-equal (ratio 1, KL exactly 0)."""
        if not getattr(self, "_checkpointing_seen", False):
            self._checkpointing_seen = activation_checkpointing(self.model)
        return self._checkpointing_seen

    def _savings_now(self, training: bool | None = None) -> tuple[bool, bool, bool]:
        """``(share prompts, skip zero-advantage rows, pack completions)`` for the model as it is now.

        The per-architecture part (``savings_decision``) is cached per model; training noise is asked at each use
        (``training_noise``, train mode only), so every path sees the current decision; a saving that is off is logged
        once per model and reason. Under activation checkpointing "pack completions" means the one-sequence forward
        (``SavingsDecision.sequence``). With an option whose result depends on every token of the batch
        (``_padded_forward_reason``: TRL's MoE load-balancing loss, its entropy mask) the log-prob forwards run every
        row in full and no row is skipped; generation still shares.

        Args:
            training: judge the forward in train (True) or eval (False) mode; None (default): the model's mode now."""
        share, skip, pack = getattr(self, "_speed_requested", (False, False, False))
        if not (share or skip):
            return False, False, False
        decision = savings_decision(self.model)
        noise = training_noise(self.model) if (self.model.training if training is None else training) else None
        # Skipping a row is exact only where a zero advantage gives a zero gradient: the loss's registry entry says,
        # and no term outside the policy loss gives such a row a gradient (TRL's entropy bonus does; its entropy
        # and off-policy masks only zero policy-loss tokens, and beta != 0 is checked at each use)
        loss = POLICY_LOSSES.get(self.args.pg_loss_type)
        loss_reason = (
            None
            if loss.zero_advantage_zero_gradient
            else (f"pg_loss_type={loss.name!r} does not declare that a zero weight gives a zero gradient")
        )
        bonus = _entropy_bonus_option(self.args)
        if loss_reason is None and bonus is not None:
            loss_reason = f"{bonus} adds an entropy bonus, which gives a rollout of advantage 0 a gradient"
        # an option whose result depends on every token of the batch: the log-prob forwards run padded, as upstream
        padded = self._padded_forward_reason()
        forwards = f"share_prompt_cache{' and pack_completions' if pack else ''} in the log-prob forwards"
        names = ("share_prompt_cache", "skip_zero_advantage_rows", "pack_completions")
        pack_reason = (decision.pack or noise) if pack else None
        if share and padded:  # generation still shares its prompt cache
            names, pack_reason = (*names[:2], forwards), padded
        elif share and self._checkpointing():
            # no cache in a checkpointed training forward: the log-prob forwards share prompts only in the
            # one-sequence forward, which packs the completions too
            names = (*names[:2], forwards)
            if not pack:
                pack_reason = (
                    "under gradient checkpointing they share prompts only in the padding-free one-sequence forward, "
                    "and pack_completions=False"
                )
            elif decision.sequence or noise:
                pack_reason = (
                    "gradient checkpointing keeps no cache in training, and the one-sequence forward that shares "
                    f"without one is not exact here ({decision.sequence or noise})"
                )
            else:
                pack_reason = None
        decision = SavingsDecision(
            share_prompts=(decision.share_prompts or noise) if share else None,
            skip_rows=(loss_reason or padded or decision.skip_rows or noise) if skip else None,
            pack=pack_reason,
        )
        announce(self.model, decision, names)
        shared = share and decision.share_prompts is None
        return shared, skip and decision.skip_rows is None, pack and shared and pack_reason is None

    def _padded_forward_reason(self) -> str | None:
        """Why the log-prob forwards must run every row padded, in one batch, as upstream (no prompt shared in them,
        no completion packed, no zero-advantage row skipped; generation still shares its prompt cache), or None.

        These savings change a forward's float rounding by a last bit; that is exact enough for a loss summed over
        tokens, but not for an option whose result depends on every token of the batch at once:

        - TRL's MoE load-balancing loss (``aux_loss_enabled``): router logits of every token of every row, as the
          batch holds them -- a shared prompt, a packed row or a skipped row would change it;
        - ``top_entropy_quantile`` < 1 (TRL's ``get_high_entropy_mask``): the policy loss is kept on the tokens whose
          entropy is at least a quantile of the whole batch's response tokens. Entropies lie close together (on a
          random tiny Llama 23 tokens within 2e-4 nats, about 20 float32 steps at 10.8, and the first tokens of a
          group tie exactly), so a last-bit difference moves a token across the threshold and its whole policy
          gradient in or out: measured (loss_type dapo, AdamW 1e-2, 2 steps), one mask bit of 23 flipped and the
          weights ended 0.0086 from upstream's against an update of 0.015; padded, 1.1e-6.

        Per-row comparisons with a constant -- the clip range, ``off_policy_mask_threshold``'s mean KL of one
        sequence, ``use_adaptive_entropy``'s target -- are like any float comparison: a flip needs the value within
        rounding of the constant, so they keep the savings (an entropy bonus turns only the row skipping off,
        ``_savings_now``).
        """
        if getattr(self, "aux_loss_enabled", False):
            return (
                f"the MoE load-balancing loss (router_aux_loss_coef={self.router_aux_loss_coef:g}) is computed over "
                "every token of every row of the batch"
            )
        quantile = getattr(self.args, "top_entropy_quantile", 1.0)
        if quantile < 1.0:
            return (
                f"top_entropy_quantile={quantile!r} keeps the tokens above a quantile of the whole batch's entropies, "
                "where a last-bit rounding difference moves a token across the threshold"
            )
        return None

    @property
    def _share_prompts(self) -> bool:
        """Prompt-cache sharing is on for the model as it is now (``_savings_now``)."""
        return self._savings_now()[0]

    @property
    def _skip_zero_advantage(self) -> bool:
        """Zero-advantage row skipping is on for the model as it is now (``_savings_now``)."""
        return self._savings_now()[1]

    @property
    def _pack(self) -> bool:
        """Padding-free completion packing is on for the model as it is now (``_savings_now``)."""
        return self._savings_now()[2]

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        # TRL 1.16's method passes no position_ids, so in a left-padded row every token sits `padding` positions
        # later than in generation, which derives them from the attention mask
        # (transformers GenerationMixin._prepare_position_ids_for_generation); vLLM sees unpadded prompts from 0.
        # With learned absolute positions (GPT-2) the log-probs then differ. Give each chunk's forward the
        # generation positions; multimodal models compute their own (e.g. M-RoPE) and are left alone.
        # With share_prompt_cache, each chunk's distinct prompts run once (trl_ext.speed.shared_prompts).
        unwrapped = self.accelerator.unwrap_model(model)
        if any(kwargs.get(key) is not None for key in FORWARD_KEYS) or not accepts_position_ids(unwrapped):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        # Under activation checkpointing the training forward keeps no cache: the old, reference and training
        # forwards then all share prompts in one cache-free forward (forward_in_one_sequence) or all run unshared,
        # so that log-probs of equal weights stay bit-equal (ratio 1, KL exactly 0) -- TRL turns checkpointing off
        # around the no-grad forwards, so the path follows _checkpointing(), not the model's state at the call.
        # With the MoE aux loss or TRL's entropy mask (over every token of the batch) every log-prob forward runs
        # unshared, as upstream (_padded_forward_reason; _savings_now says so; pack is then off).
        shared, _, pack = self._savings_now()
        if self._checkpointing():
            path = "sequence" if pack else None
        else:
            path = "cache" if shared and self._padded_forward_reason() is None else None
        cache_name = cache_argument(unwrapped) if path == "cache" else None
        prompt_length = input_ids.size(1) - logits_to_keep

        def forward_with_positions(**inputs):
            inputs.setdefault("position_ids", position_ids_from_attention_mask(inputs["attention_mask"]))
            if path == "sequence":  # one forward of the (possibly DDP-wrapped) model, as upstream
                return forward_in_one_sequence(model, prompt_length, **inputs)
            if path == "cache":  # the prefill runs unwrapped: one DDP forward per chunk on every rank, as upstream
                return forward_with_shared_prompts(
                    model, prompt_length, cache_name=cache_name, prefill_model=unwrapped, pack=pack, **inputs
                )
            return model(**inputs)

        return super()._get_per_token_logps_and_entropies(
            forward_with_positions, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )

    @contextlib.contextmanager
    def _generation_savings(self, rows: int):
        """A block in which transformers generation (``trl.GRPOTrainer._generate_single_turn``, which the trainer
        calls inside it) samples the same tokens and random numbers as ``torch.multinomial``, 3x faster
        (``trl_ext.speed.sampling``), with linear weights packed once per generation batch
        (``trl_ext.speed.packed_linear``, ``prepack_linear_weights``; ``rows``: prompts decoded a step, upstream's
        one generate call -- per_device_train_batch_size x steps_per_generation in training -- the row count packed
        for) and each distinct prompt prefilled once (``share_prompt_cache``). Nothing with vLLM."""
        if self.use_vllm:
            yield
            return
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        packed = getattr(self, "_packed_linear", None)
        packing = packed.applied(unwrapped, rows=rows) if packed is not None else nullcontext()
        with same_draws_multinomial(), packing, self._sharing_prompts(unwrapped):
            yield

    def _fixed_generation_weights(self):
        """A block in which the policy's weights do not change (one generation batch: all its rounds drawn and
        scored, no optimizer step), so the linear weights generation packs (``prepack_linear_weights``) are packed
        once for all its generate calls and dropped at its end, before the loss's forward and backward: the next
        batch packs the weights as they are then (``trl_ext.speed.packed_linear``)."""
        packed = getattr(self, "_packed_linear", None)
        return packed.fixed_weights() if packed is not None else nullcontext()

    @contextlib.contextmanager
    def _sharing_prompts(self, unwrapped):
        # Upstream calls `unwrapped_model.generate(input_ids=..., attention_mask=..., generation_config=...)` on
        # accelerator.unwrap_model(model_wrapped); an instance attribute shadows the method for this block only.
        # Multimodal inputs reach generate as tensors, which generate_with_shared_prompts passes through unshared.
        if not self._share_prompts or not hasattr(unwrapped, "generate"):
            yield
            return
        shared = generate_with_shared_prompts(
            unwrapped.generate, unwrapped, cache_argument(unwrapped), accepts_position_ids(unwrapped)
        )
        with shadowing_generate(unwrapped, shared):
            yield

    def _rows_without_gradient(self, inputs, extra_inputs) -> torch.Tensor | None:
        """(B,) bool: rows whose loss and gradient are exactly 0 -- advantage 0 (for ``no_baseline``, whose estimator
        is ``raw_rewards``: reward 0) makes a loss that declares ``zero_advantage_zero_gradient`` (``_savings_now``
        checks) 0 at every token, TRL's entropy and off-policy masks keep it 0, and with beta = 0 and no entropy bonus
        (``_savings_now`` checks) nothing else is added. None when nothing is skipped: an option off, evaluation,
        beta != 0, multimodal or MoE inputs, or no such row."""
        if not (self._skip_zero_advantage and self.model.training and self.beta == 0.0) or self.aux_loss_enabled:
            return None
        if any(value is not None for value in extra_inputs.values()):
            return None
        zero = inputs["advantages"] == 0
        if not zero.any():
            return None
        if zero.all():  # keep one row: the loss must stay connected to the model (and DDP's backward run)
            zero = zero.clone()
            zero[0] = False
        return zero

    def _logps_without_zero_rows(self, model, input_ids, attention_mask, logits_to_keep, zero_rows):
        """Per-token log-probs and entropies (B, C) as ``_get_per_token_logps_and_entropies`` gives them, with the
        ``zero_rows`` computed without gradient (their loss is exactly 0; their values feed the metrics). Under DDP
        that forward runs on the unwrapped module, so every rank makes one wrapped forward, as upstream."""
        keep = ~zero_rows
        kept_logps, kept_entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids[keep], attention_mask[keep], logits_to_keep, compute_entropy=True
        )
        with torch.no_grad():
            zero_logps, zero_entropies, _ = self._get_per_token_logps_and_entropies(
                self.accelerator.unwrap_model(model),
                input_ids[zero_rows],
                attention_mask[zero_rows],
                logits_to_keep,
                compute_entropy=True,
            )
        # rows back in batch order: kept rows first, then the zero rows, permuted by where each came from
        order = torch.cat([keep.nonzero(), zero_rows.nonzero()]).squeeze(1).argsort()
        per_token_logps = torch.cat([kept_logps, zero_logps])[order]
        entropies = torch.cat([kept_entropies.detach(), zero_entropies])[order]
        return per_token_logps, entropies, None
