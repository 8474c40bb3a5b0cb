"""GRPO-No-Clip (the handout's clip ablation): -ratio * A per token, by hand and inside trl_ext.GRPOTrainer."""

import math

import pytest
import torch
from conftest import length_mod5_reward
from test_grpo_trainer import COMMON, generation_batch, independent_log_probs, make_trainer

import trl_ext
from trl_ext import functional
from trl_ext.objective import course as C
from trl_ext.objective import losses

RATIO = math.exp(0.5)  # log-prob -0.5 under the policy, -1.0 under the old policy: ratio = e^(-0.5 - -1.0)


def test_grpo_no_clip_loss_and_gradient_by_hand():
    logp = torch.tensor([[-0.5]], requires_grad=True)
    loss, meta = functional.compute_grpo_no_clip_loss(torch.tensor([[2.0]]), logp, torch.tensor([[-1.0]]))
    # loss = -ratio * A = -2 e^0.5 = -3.29744; d loss / d logp = -A * d ratio / d logp = -A * ratio = -3.29744
    assert loss.item() == pytest.approx(-3.2974, abs=1e-4)
    assert loss.item() == pytest.approx(-2 * RATIO, rel=1e-6)
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(-3.2974, abs=1e-4)
    assert meta["ratio"].item() == pytest.approx(RATIO, rel=1e-6)
    assert meta["clipped"].tolist() == [[False]]


def test_grpo_no_clip_differs_from_grpo_clip_where_the_clip_binds():
    # same token with cliprange 0.2: -min(1.6487 * 2, 1.2 * 2) = -2.4 and no gradient (the clipped term is constant)
    logp = torch.tensor([[-0.5]], requires_grad=True)
    clip_loss, clip_meta = functional.compute_grpo_clip_loss(torch.tensor([[2.0]]), logp, torch.tensor([[-1.0]]), 0.2)
    assert clip_loss.item() == pytest.approx(-2.4)
    assert clip_meta["clipped"].tolist() == [[True]]
    clip_loss.sum().backward()
    assert logp.grad.item() == 0.0


def test_grpo_no_clip_through_dispatch_and_microbatch_step_by_hand():
    # two response tokens at logp -0.5 (old -1.0) and one padded token; A = 2, masked_mean, 2 accumulation steps:
    # per-token loss -3.29744 -> per-example mean -3.29744 -> batch mean -> / 2 = -1.64872;
    # gradient per response token = -3.29744 * (1/2 tokens) * (1/2 accumulation) = -0.82436, padding 0.
    logp = torch.tensor([[-0.5, -0.5, -7.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    per_token, _ = losses.compute_policy_gradient_loss(
        logp, "grpo_no_clip", advantages=torch.tensor([2.0]), old_log_probs=old
    )
    assert per_token[0, :2].tolist() == pytest.approx([-2 * RATIO] * 2, rel=1e-6)
    loss, meta = C.grpo_microbatch_train_step(
        logp, mask, 2, "grpo_no_clip", advantages=torch.tensor([[2.0]]), old_log_probs=old
    )
    assert loss.item() == pytest.approx(-RATIO, rel=1e-6)
    assert logp.grad[0].tolist() == pytest.approx([-RATIO / 2, -RATIO / 2, 0.0], rel=1e-6)
    assert "ratio" in meta
    with pytest.raises(ValueError, match="loss_type='grpo_no_clip' needs old_log_probs"):
        losses.compute_policy_gradient_loss(logp, "grpo_no_clip", advantages=torch.tensor([2.0]))
    with pytest.raises(ValueError, match="old_log_probs has shape"):
        functional.compute_grpo_no_clip_loss(torch.tensor([2.0]), logp, torch.zeros(1, 2))


def test_config_accepts_grpo_no_clip_with_reused_rollouts(tmp_path):
    config = trl_ext.GRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        bf16=False,
        use_cpu=True,
        pg_loss_type="grpo_no_clip",
        num_iterations=2,
        steps_per_generation=2,
        per_device_train_batch_size=4,
        num_generations=4,
    )
    assert config.pg_loss_type == "grpo_no_clip" and config.num_iterations == 2
    assert losses.POLICY_LOSSES.get("grpo_no_clip").uses_old_log_probs


def test_trainer_uses_old_log_probs_with_num_iterations_2(tokenizer, tiny_model_dir, tmp_path):
    """Off-policy correctness: with num_iterations=2 the trainer's loss is -ratio * A against the stored old
    log-probs of the sampling policy (not a ratio of 1), as an independent forward pass computes it."""
    trainer = make_trainer(
        trl_ext.GRPOTrainer,
        trl_ext.GRPOConfig,
        tiny_model_dir,
        tokenizer,
        tmp_path,
        pg_loss_type="grpo_no_clip",
        num_iterations=2,
        beta=0.0,
    )
    batch = generation_batch(trainer)
    assert batch.get("old_per_token_logps") is not None, "TRL must store the sampling policy's log-probs"
    raw = torch.tensor(
        length_mod5_reward(trainer.processing_class.batch_decode(batch["completion_ids"], skip_special_tokens=True))
    )
    advantages = functional.compute_group_advantages(raw, 4, 1e-6, True)
    torch.testing.assert_close(batch["advantages"], advantages)
    # Pretend the policy moved since sampling: old log-probs shifted by -0.5 -> ratio e^0.5 on every token.
    inputs = dict(batch)
    with torch.no_grad():
        current = independent_log_probs(trainer.model, inputs, COMMON["temperature"])
    inputs["old_per_token_logps"] = current - 0.5
    loss = trainer._compute_loss(trainer.model, inputs)
    # masked_mean of a constant per row is that constant: loss = mean_i(-e^0.5 * A_i)
    expected = (-RATIO * advantages * (inputs["completion_mask"].sum(1) > 0)).mean()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    metrics = trainer._metrics["train"]
    assert metrics["ratio/mean"][-1] == pytest.approx(RATIO, rel=1e-4)
    assert metrics["ratio/min"][-1] == pytest.approx(RATIO, rel=1e-4)
    assert metrics["ratio/max"][-1] == pytest.approx(RATIO, rel=1e-4)
    assert metrics["clip_ratio/region_mean"][-1] == 0.0
