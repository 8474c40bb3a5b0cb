"""trl_ext.GRPOTrainer: position ids of left-padded rows (issue 10 item 5) and rows masked as truncated (item 6)."""

from __future__ import annotations

import pytest
import torch
import trl
from conftest import tiny_gpt2
from tiny import tiny_grpo_trainer, tiny_model_for_tests

from trl_ext import functional
from trl_ext.objective import aggregations


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def make_trainer(model, tokenizer, tmp_path, **overrides):
    settings = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=4, temperature=1.0)
    return tiny_grpo_trainer(model, tokenizer, tmp_path, ["a", "b"], constant_reward, **settings, **overrides)


def left_padded(rows, pad_id):
    """Left-pad token lists to one (B, T) batch with its attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.fixture(params=["gpt2", "llama"])
def model_kind(request):
    return request.param


def build_model(kind, tokenizer):
    return tiny_gpt2(tokenizer) if kind == "gpt2" else tiny_model_for_tests(tokenizer)


def test_left_padded_log_probs_equal_unpadded_ones(model_kind, tokenizer, tmp_path):
    trainer = make_trainer(build_model(model_kind, tokenizer), tokenizer, tmp_path)
    prompts = [[101, 102, 103, 104, 105, 106, 107, 108, 109], [201, 202]]  # the second row gets 7 pads
    completions = [[301, 302, 303, 304], [401, 402, 403, 404]]
    ids, mask = left_padded([p + c for p, c in zip(prompts, completions)], tokenizer.pad_token_id)
    with torch.no_grad():
        padded, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4)
        alone = [
            trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.tensor([p + c]), torch.ones(1, len(p + c), dtype=torch.long), 4
            )[0]
            for p, c in zip(prompts, completions)
        ]
        upstream, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, 4)
    torch.testing.assert_close(padded, torch.cat(alone), atol=1e-5, rtol=0)
    if model_kind == "gpt2":  # the fault this guards against: upstream shifts the padded row's absolute positions
        assert (upstream[1] - alone[1][0]).abs().max() > 1e-3
        torch.testing.assert_close(upstream[0], alone[0][0], atol=1e-5, rtol=0)  # the unpadded row is unaffected


def test_generation_and_log_prob_pass_use_the_same_positions(model_kind, tokenizer, tmp_path):
    trainer = make_trainer(build_model(model_kind, tokenizer), tokenizer, tmp_path)
    prompt_ids, prompt_mask = left_padded([[101, 102, 103, 104, 105, 106], [201]], tokenizer.pad_token_id)
    with torch.no_grad():
        out = trainer.model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
        )
        completion = out.sequences[:, prompt_ids.size(1) :]
        sampled = torch.stack(
            [
                torch.log_softmax(step.float(), -1).gather(-1, completion[:, t : t + 1]).squeeze(-1)
                for t, step in enumerate(out.logits)
            ],
            dim=1,
        )
        ids = torch.cat([prompt_ids, completion], dim=1)
        mask = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1)
        scored, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4)
    torch.testing.assert_close(scored, sampled, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------ truncated rows
def test_rows_without_trained_tokens_leave_the_batch_mean():
    loss = torch.ones(2, 5, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])  # A: 3 tokens; B: truncated and masked
    assert aggregations.compute_grpo_loss(loss, mask, empty_rows="drop").item() == pytest.approx(1.0)
    assert aggregations.compute_grpo_loss(loss, mask, empty_rows="zero").item() == pytest.approx(
        0.5
    )  # upstream's dilution
    # masked_normalize: mean over the remaining rows of sum / max_completion_length = 3 / 5
    assert aggregations.compute_grpo_loss(loss, mask, "masked_normalize", 5, empty_rows="drop").item() == pytest.approx(
        0.6
    )
    three = torch.tensor([[2.0, 2.0, 0.0], [1.0, 3.0, 5.0], [7.0, 7.0, 7.0]])
    three_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    # rows: mean 2 and mean 3 -> 2.5; sums 4 and 9 over 3 -> (4/3 + 3) / 2
    assert aggregations.compute_grpo_loss(three, three_mask, empty_rows="drop").item() == pytest.approx(2.5)
    assert aggregations.compute_grpo_loss(
        three, three_mask, "masked_normalize", 3, empty_rows="drop"
    ).item() == pytest.approx((4 / 3 + 3) / 2)
    # every row masked: 0 with finite (zero) gradients, for both normalizations
    for normalization, constant in (("masked_mean", None), ("masked_normalize", 5)):
        x = torch.full((2, 5), 3.0, requires_grad=True)
        total = aggregations.compute_grpo_loss(x, torch.zeros(2, 5), normalization, constant, empty_rows="drop")
        total.backward()
        assert total.item() == 0.0
        assert torch.equal(x.grad, torch.zeros(2, 5))
    # masked_mean itself keeps the course semantics: NaN on an empty slice
    assert torch.isnan(functional.masked_mean(torch.ones(2, 5), mask, dim=-1)[1])


@pytest.mark.parametrize("length_normalization", ["masked_mean", "masked_normalize"])
def test_trainer_loss_ignores_a_masked_truncated_row(length_normalization, tokenizer, tmp_path):
    trainer = make_trainer(
        tiny_model_for_tests(tokenizer),
        tokenizer,
        tmp_path,
        pg_loss_type="reinforce_with_baseline",
        length_normalization=length_normalization,
        mask_truncated_completions=True,
        beta=0.0,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    prompt_ids, prompt_mask = left_padded([[101, 102, 103], [201, 202, 203]], tokenizer.pad_token_id)
    completion_ids = torch.tensor([[301, 302, tokenizer.eos_token_id, tokenizer.pad_token_id], [401, 402, 403, 404]])
    completion_mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])  # row B was truncated: masked entirely
    inputs = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=torch.tensor([1.5, -2.0]),
        old_per_token_logps=None,
    )
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    # independent: a plain forward of row A alone (no TRL code), -A * log p over its 3 tokens
    ids = torch.cat([prompt_ids[:1], completion_ids[:1, :3]], dim=1)
    logits = trainer.model(input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)[:, -3:]
    per_row = (-1.5 * logp).sum() / (3 if length_normalization == "masked_mean" else 4)
    torch.testing.assert_close(loss, per_row, atol=1e-5, rtol=1e-5)

    # every row masked (all truncated): loss 0, finite gradients
    trainer.model.zero_grad()
    inputs["completion_mask"] = torch.zeros_like(completion_mask)
    empty = trainer._compute_loss(trainer.model, dict(inputs))
    empty.backward()
    assert empty.item() == 0.0
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_metrics_of_a_step_without_trained_tokens_are_nan_and_leave_the_logged_average(
    tokenizer, tiny_model_dir, tmp_path
):
    """Every completion masked (all truncated): entropy, kl, clip_ratio/* and ratio/* have nothing to average. They
    are NaN (as upstream's nanmin/nanmax give for clip_ratio/low_min and high_max), never 0 or the float extremes
    +-3.4e38, and upstream's log() leaves them out of the logging window: the logged value is that of the step with
    tokens alone, and None when no step had any."""
    import math

    trainer = make_trainer(  # beta > 0: a reference model, loaded from a directory
        str(tiny_model_dir),
        tokenizer,
        tmp_path,
        pg_loss_type="grpo_clip",
        beta=0.04,
        mask_truncated_completions=True,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    prompt_ids, prompt_mask = left_padded([[101, 102, 103], [201, 202, 203]], tokenizer.pad_token_id)
    completion_ids = torch.tensor([[301, 302, tokenizer.eos_token_id, tokenizer.pad_token_id], [401, 402, 403, 404]])
    # old/reference log-probs set so every ratio is e^0.1 and every k3 KL is e^-0.1 + 0.1 - 1 (no model needed)
    with torch.no_grad():
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        logits = trainer.model(
            input_ids=ids, attention_mask=torch.cat([prompt_mask, torch.ones_like(completion_ids)], 1)
        ).logits
        logp = torch.log_softmax(logits[:, -5:-1].float(), -1).gather(-1, completion_ids[..., None]).squeeze(-1)
    inputs = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
        advantages=torch.tensor([1.0, -1.0]),
        old_per_token_logps=logp - 0.1,
        ref_per_token_logps=logp - 0.1,
    )
    keys = (
        "entropy",
        "kl",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
        "ratio/mean",
        "ratio/min",
        "ratio/max",
    )

    trainer._compute_loss(trainer.model, dict(inputs, completion_mask=torch.zeros(2, 4, dtype=torch.long)))
    metrics = trainer._metrics["train"]
    assert all(math.isnan(metrics[key][-1]) for key in keys), {key: metrics[key][-1] for key in keys}
    trainer.log({})
    logged = trainer.state.log_history[-1]
    assert all(logged[key] is None for key in keys), {key: logged[key] for key in keys}

    # one step with tokens, one without, in the same logging window: the logged values are the first step's
    trainer._compute_loss(trainer.model, dict(inputs))
    trainer._compute_loss(trainer.model, dict(inputs, completion_mask=torch.zeros(2, 4, dtype=torch.long)))
    trainer.log({})
    logged = trainer.state.log_history[-1]
    ratio, kl = math.exp(0.1), math.exp(-0.1) + 0.1 - 1  # k3 = e^(ref - logp) - (ref - logp) - 1, ref - logp = -0.1
    assert logged["ratio/mean"] == pytest.approx(ratio, rel=1e-5)
    assert logged["ratio/min"] == pytest.approx(ratio, rel=1e-5) and logged["ratio/max"] == pytest.approx(
        ratio, rel=1e-5
    )
    assert logged["kl"] == pytest.approx(kl, rel=1e-4)
    # e^0.1 = 1.105 is inside [0.8, 1.2]: nothing clipped, in the 7 trained tokens and in each row
    for key in (
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
    ):
        assert logged[key] == 0.0, key
    entropy = torch.distributions.Categorical(logits=logits[:, -5:-1].float()).entropy()
    expected_entropy = (entropy[0, :3].sum() + entropy[1].sum()) / 7
    assert logged["entropy"] == pytest.approx(expected_entropy.item(), rel=1e-4)
