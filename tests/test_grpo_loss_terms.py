"""TRL's GRPO terms and masks around the policy loss, through trl_ext.GRPOTrainer, against upstream trl.GRPOTrainer.

The options (trl_ext/trainers/grpo/terms.py): ``entropy_coef`` (a static entropy bonus), ``use_adaptive_entropy``
(Skywork-OR1's controller), ``top_entropy_quantile`` < 1 (the policy loss on the highest-entropy tokens only) and
``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence mask). For each: the loss, gradients and metrics of
one batch equal upstream's (with trl_ext's shared-prompt, packed forward); an unchanged ``trl.GRPOConfig`` with the
option trains to upstream's weights (steps_per_generation 4 over 2 accumulation steps, so half the micro-batches are
off-policy); and the zero-advantage row skipping turns off exactly where a zero advantage can have a gradient.
"""

import copy

import pytest
import torch
import trl
from conftest import length_mod5_reward
from test_grpo_trainer import (
    COMMON,
    generation_batch,
    independent_log_probs,
    loss_and_grads,
    make_trainer,
    perturb_for_clipping,
    toy_dataset,
)

import trl_ext

OPTIONS = {
    "entropy_coef": dict(entropy_coef=0.5),
    "top_entropy_quantile": dict(top_entropy_quantile=0.2),
    "off_policy_mask_threshold": dict(off_policy_mask_threshold=0.02),
    # the bonus on the tokens the entropy mask keeps
    "entropy_coef+top_entropy_quantile": dict(entropy_coef=0.5, top_entropy_quantile=0.3),
}


@pytest.mark.parametrize(
    "option, loss_type",
    # dapo: TRL's default; a token mean over the generation batch, whose policy_loss upstream logs divided by the
    # accumulation steps
    [("entropy_coef", "grpo"), ("top_entropy_quantile", "grpo"), ("off_policy_mask_threshold", "grpo")]
    + [("entropy_coef+top_entropy_quantile", "dapo")],
)
def test_one_batch_with_the_option_has_upstreams_loss_gradients_and_metrics(
    option, loss_type, tokenizer, tiny_model_dir, tmp_path
):
    """Same batch, old and reference log-probs perturbed by up to +-0.6 (some sequences off-policy, some tokens
    clipped): trl_ext's loss (its forward shares each prompt's cache and packs the completions) and upstream's are
    the same function, beta > 0 (the KL term stays unmasked), accumulation 2; and the option changes it."""
    shared = dict(
        beta=0.04,
        epsilon=0.2,
        num_iterations=2,
        gradient_checkpointing=False,
        loss_type=loss_type,
        scale_rewards="group",
        gradient_accumulation_steps=2,
        use_bias_correction_kl=True,  # upstream's default (the course's is False)
    )
    runs = {}
    for name in ("ours", "upstream"):
        cls, config = (trl_ext.GRPOTrainer, trl_ext.GRPOConfig) if name == "ours" else (trl.GRPOTrainer, trl.GRPOConfig)
        extra = dict(advantage_eps=1e-4) if name == "ours" else {}
        trainer = make_trainer(cls, config, tiny_model_dir, tokenizer, tmp_path, **shared, **OPTIONS[option], **extra)
        inputs = perturb_for_clipping(generation_batch(trainer))
        trainer.accelerator.gradient_state._set_sync_gradients(True)  # the optimizer step's last micro-batch
        runs[name] = trainer, inputs, *loss_and_grads(trainer, dict(inputs))
    (ours, inputs, loss, grads), (ref, ref_inputs, ref_loss, ref_grads) = runs["ours"], runs["upstream"]
    assert torch.equal(inputs["completion_ids"], ref_inputs["completion_ids"])
    torch.testing.assert_close(inputs["advantages"], ref_inputs["advantages"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    assert ref._metrics["train"].keys() - {"step_time"} <= ours._metrics["train"].keys()
    for key in ("entropy", "kl", "policy_loss", "entropy_coef", "clip_ratio/region_mean"):
        if key in ref._metrics["train"]:
            assert ours._metrics["train"][key][-1] == pytest.approx(ref._metrics["train"][key][-1], abs=1e-6), key
    assert ("policy_loss" in ours._metrics["train"]) == ("entropy_coef" in OPTIONS[option])
    # the option matters on this batch, by far more than the tolerance: upstream with it off
    ref.top_entropy_quantile, ref.off_policy_mask_threshold = 1.0, None
    ref.entropy_coef, ref._entropy_bonus_enabled = 0.0, False
    _, off_grads = loss_and_grads(ref, dict(ref_inputs))
    assert max((off_grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads) > 1e-4


def test_the_entropy_bonus_is_the_mean_entropy_of_the_masked_tokens(tokenizer, tiny_model_dir, tmp_path):
    """By hand: with every advantage 0 and beta 0 the policy loss is 0, so the loss is -coef x the mean entropy of
    the response tokens the entropy mask keeps (the top 30% of the batch's tokens by entropy), / accumulation 2."""
    trainer = make_trainer(
        trl_ext.GRPOTrainer,
        trl_ext.GRPOConfig,
        tiny_model_dir,
        tokenizer,
        tmp_path,
        beta=0.0,
        entropy_coef=0.5,
        top_entropy_quantile=0.3,
        gradient_accumulation_steps=2,
        gradient_checkpointing=False,
    )
    inputs = generation_batch(trainer)
    inputs["advantages"] = torch.zeros_like(inputs["advantages"])
    loss, grads = loss_and_grads(trainer, dict(inputs))
    # an independent entropy: a plain forward's softmax at the sampling temperature
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / COMMON["temperature"]
    probs = torch.softmax(logits, -1)
    entropy = -(probs * torch.log(probs)).sum(-1)[:, -inputs["completion_ids"].size(1) :]
    mask = inputs["completion_mask"].bool()
    threshold = torch.quantile(entropy[mask], 0.7)
    kept = mask & (entropy >= threshold)
    assert 0 < kept.sum() < mask.sum()
    expected = -0.5 * entropy[kept].mean() / 2
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-4)
    assert any(g.abs().max() > 0 for g in grads.values())  # advantage 0, yet a gradient: the entropy's


# ----- the zero-advantage row skipping -----


def test_an_entropy_bonus_turns_the_row_skipping_off_in_one_line(tokenizer, tiny_model_dir, tmp_path, caplog):
    for options, line in (
        (dict(entropy_coef=0.01), "entropy_coef=0.01 adds an entropy bonus"),
        (dict(use_adaptive_entropy=True), "use_adaptive_entropy=True adds an entropy bonus"),
    ):
        caplog.clear()
        with caplog.at_level("WARNING", logger="trl_ext"):
            trainer = make_trainer(
                trl_ext.GRPOTrainer, trl_ext.GRPOConfig, tiny_model_dir, tokenizer, tmp_path, beta=0.0, **options
            )
            trainer._savings_now(training=True)  # asked again at a use: no second line
        assert not trainer._skip_zero_advantage and trainer._share_prompts
        said = [r.getMessage() for r in caplog.records if "skip_zero_advantage_rows off" in r.getMessage()]
        assert len(said) == 1 and f"skip_zero_advantage_rows off: {line}" in said[0], said
        inputs = generation_batch(trainer)
        inputs["advantages"] = torch.tensor([0.0, 1.5, 0.0, -0.5])
        assert trainer._rows_without_gradient(inputs, {}) is None  # every row's backward runs
    # dynamic sampling only chooses the groups a batch trains on: it stays allowed with a bonus
    config = trl_ext.GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", entropy_coef=0.01, dynamic_sampling=True
    )
    assert config.dynamic_sampling


# The entropy mask turns the skipping off (its quantile is over every token of the batch, the skipped rows' included:
# test_the_entropy_mask_takes_its_quantile_over_upstreams_entropies_bit_for_bit)
@pytest.mark.parametrize("options", [dict(off_policy_mask_threshold=0.02)], ids=["off_policy"])
def test_the_masks_keep_zero_advantage_rows_skipped_with_the_same_loss_and_gradients(
    options, tokenizer, tiny_model_dir, tmp_path
):
    """A masked policy loss still gives a row of advantage 0 no gradient: skipped (its forward without gradient) or
    not, the loss and gradients are the same -- and upstream's. The off-policy mask compares one sequence's mean KL
    with a constant, so it keeps the skipping on."""
    runs = {}
    for skip in (True, False):
        trainer = make_trainer(
            trl_ext.GRPOTrainer,
            trl_ext.GRPOConfig,
            tiny_model_dir,
            tokenizer,
            tmp_path,
            beta=0.0,
            num_iterations=2,
            gradient_checkpointing=False,
            advantage_eps=1e-4,
            skip_zero_advantage_rows=skip,
            **options,
        )
        assert trainer._skip_zero_advantage == skip
        inputs = perturb_for_clipping(generation_batch(trainer))
        inputs["advantages"] = torch.tensor([0.0, 1.5, 0.0, -0.5])
        if skip:
            assert trainer._rows_without_gradient(inputs, {}).tolist() == [True, False, True, False]
        runs[skip] = loss_and_grads(trainer, dict(inputs))
    upstream = make_trainer(
        trl.GRPOTrainer,
        trl.GRPOConfig,
        tiny_model_dir,
        tokenizer,
        tmp_path,
        loss_type="grpo",
        scale_rewards="group",
        beta=0.0,
        num_iterations=2,
        gradient_checkpointing=False,
        **options,
    )
    runs["upstream"] = loss_and_grads(upstream, dict(inputs))
    loss, grads = runs[True]
    assert loss != 0
    if "off_policy_mask_threshold" in options:  # the mask drops a row here: row 3, advantage -0.5, mean KL > 0.02
        log_probs = independent_log_probs(upstream.model, inputs, COMMON["temperature"]).detach()
        kept = trl.GRPOTrainer.get_off_policy_mask(
            inputs["advantages"][:, None], log_probs, inputs["old_per_token_logps"], inputs["completion_mask"], 0.02
        )
        assert kept.squeeze(1).tolist() == [1, 1, 1, 0]
    for other in (False, "upstream"):
        torch.testing.assert_close(loss, runs[other][0], atol=1e-6, rtol=1e-5)
        for name in runs[other][1]:
            torch.testing.assert_close(grads[name], runs[other][1][name], atol=1e-6, rtol=1e-4, msg=name)


# ----- training: an unchanged trl.GRPOConfig with the option trains trl_ext.GRPOTrainer to upstream's weights -----

# the settings of test_grpo_trainer.test_upstream_default_token_means_train_as_upstream_with_accumulation: 2 optimizer
# steps of 2 accumulated micro-batches of 2 completions, all from one generation batch of 8 (steps_per_generation 4):
# the second step trains on samples of the policy before the first (old log-probs != current: off-policy)
TRAINING = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    steps_per_generation=4,
    max_completion_length=12,
    optim="sgd",  # the weights move by the gradients themselves: equal weights mean equal gradients
    learning_rate=0.5,
)
TRAINED_OPTIONS = {
    "entropy_coef": dict(entropy_coef=0.5),
    # the entropy (about 10.8 nats: a random model over 49152 tokens) stays below the target: the coefficient grows by
    # delta after each step and, from the second step on, is applied
    "use_adaptive_entropy": dict(
        use_adaptive_entropy=True, entropy_coef=0.2, entropy_coef_delta=0.3, entropy_coef_max=0.7, entropy_target=50.0
    ),
    "top_entropy_quantile": dict(top_entropy_quantile=0.2),
    "off_policy_mask_threshold": dict(off_policy_mask_threshold=1e-3),
}


def recording(helper, name, record):
    """``helper`` (an upstream mask helper), appending (name, mask, advantages) to ``record`` at each call."""

    def call(*args, **kwargs):
        mask = helper(*args, **kwargs)
        record.append((name, mask.detach().clone(), kwargs.get("advantages")))
        return mask

    return call


def train_with(trainer_cls, tokenizer, model_dir, settings, record=None):
    """Train ``trainer_cls`` from an upstream ``trl.GRPOConfig`` of ``settings``; returns (weights, log history).
    ``record``: a list that gets, for each call of upstream's mask helpers, (name, mask, advantages)."""
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=length_mod5_reward,
        args=trl.GRPOConfig(**settings),
        train_dataset=toy_dataset(8),
        processing_class=copy.deepcopy(tokenizer),
    )
    if trainer_cls is trl_ext.GRPOTrainer:
        trainer.args.advantage_eps = 1e-4  # TRL hard-codes 1e-4; trl_ext's default is the course's 1e-6
    if record is not None:
        for name in ("get_high_entropy_mask", "get_off_policy_mask"):
            setattr(trainer, name, recording(getattr(trainer, name), name, record))
    torch.manual_seed(0)
    trainer.train()
    return dict(trainer.model.named_parameters()), [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("option", list(TRAINED_OPTIONS))
def test_upstream_config_with_the_option_trains_as_upstream_with_accumulation(
    option, tokenizer, tiny_model_dir, tmp_path
):
    settings = dict(
        COMMON,
        **TRAINING,
        **TRAINED_OPTIONS[option],
        output_dir=str(tmp_path / option),
        # a random model almost never ends early; +14 on the EOS logit (before temperature 1.5) ends ~1 token in 5
        generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], 14.0]]},
    )
    record = []
    ours, our_logs = train_with(trl_ext.GRPOTrainer, tokenizer, tiny_model_dir, settings, record)
    theirs, their_logs = train_with(trl.GRPOTrainer, tokenizer, tiny_model_dir, settings)
    assert len(our_logs) == len(their_logs) == 2
    for ours_step, theirs_step in zip(our_logs, their_logs):
        for key in ("loss", "entropy", "policy_loss", "entropy_coef", "clip_ratio/region_mean"):
            assert (key in ours_step) == (key in theirs_step), key
            if key in theirs_step:
                assert ours_step[key] == pytest.approx(theirs_step[key], abs=1e-6), key
    initial = dict(trl_ext.models.load_model(tiny_model_dir).named_parameters())
    assert max((theirs[n] - initial[n]).abs().max().item() for n in theirs) > 1e-3  # the steps did train
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=1e-5)
    # the option acted
    if option == "use_adaptive_entropy":  # the coefficient after each step, by hand: 0.2 + 0.3, then capped at 0.7
        assert [entry["entropy_coef"] for entry in their_logs] == pytest.approx([0.5, 0.7])
    if option == "top_entropy_quantile":
        assert record and all(0 < mask.sum() < mask.numel() for _, mask, _ in record)
    if option == "off_policy_mask_threshold":  # some sequence with a nonzero advantage dropped, in the second step
        dropped = [(mask.squeeze(1) == 0) & (advantages.squeeze(1) != 0) for _, mask, advantages in record]
        assert len(dropped) == 4 and not any(d.any() for d in dropped[:2]) and any(d.any() for d in dropped[2:])


def test_a_resume_with_another_entropy_coef_says_whether_it_is_used(tmp_path):
    """With use_adaptive_entropy in both runs the checkpoint's coefficient goes on (upstream's
    _load_optimizer_and_scheduler restores it, trl_ext's state too); a static one is the config's from now on."""
    from trl_ext.trainers.resume import changeable_options, warn_changed_options

    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    for adaptive, effect in (
        (
            True,
            "with use_adaptive_entropy the entropy coefficient goes on from the checkpoint's value (0.1 is only a "
            "starting value)",
        ),
        (False, "the steps after the checkpoint use 0.1"),
    ):
        saved = changeable_options(trl_ext.GRPOConfig(**base, entropy_coef=0.05, use_adaptive_entropy=adaptive))
        now = trl_ext.GRPOConfig(**base, entropy_coef=0.1, use_adaptive_entropy=adaptive)
        lines = warn_changed_options(f"checkpoint-{adaptive}", now, saved)
        assert lines == [f"resuming checkpoint-{adaptive}: entropy_coef was 0.05, now 0.1; {effect}"]


# ----- options over every token of the batch: the log-prob forwards run padded, as upstream (issue 45 item 2) -----


def count_to_3_scores_zero(prompts, completions, **kwargs) -> list[float]:
    """length_mod5_reward, except 0 for every completion of "Count to 3:": that group's rewards are all equal, so its
    advantages are exactly 0 (the rows zero-advantage skipping would run without gradient)."""
    lengths = length_mod5_reward(completions)
    return [0.0 if prompt == "Count to 3:" else r for prompt, r in zip(prompts, lengths, strict=True)]


def recording_entropies(trainer, record):
    """Record the entropies and mask ``trainer.get_high_entropy_mask`` is given at each call, and its result."""
    helper = trainer.get_high_entropy_mask

    def call(entropies, mask, threshold):
        kept = helper(entropies, mask, threshold)
        record.append((entropies.detach().clone(), mask.clone(), kept.clone()))
        return kept

    trainer.get_high_entropy_mask = call


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_the_entropy_mask_takes_its_quantile_over_upstreams_entropies_bit_for_bit(
    checkpointing, tokenizer, tiny_model_dir, tmp_path, caplog
):
    """top_entropy_quantile < 1 keeps the policy loss on the tokens whose entropy is at least a quantile of the whole
    batch's: a last-bit difference in one entropy can move a token across it, so trl_ext's log-prob forwards then run
    as upstream's (padded rows, none skipped; one log line): the entropies the quantile is taken over are upstream's
    bit for bit, and so are the mask, the loss and the gradients (up to the loss's own float rounding). Ragged
    completions, two rows of advantage 0 (skipped otherwise), checkpointing off and on (the one-sequence path)."""
    shared = dict(
        beta=0.0,
        num_iterations=2,
        loss_type="bnpo",
        scale_rewards="group",
        top_entropy_quantile=0.3,
        gradient_checkpointing=checkpointing,
        max_completion_length=12,
        generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], 14.0]]},  # ends ~1 token in 5
    )
    runs = {}
    for cls, config in ((trl_ext.GRPOTrainer, trl_ext.GRPOConfig), (trl.GRPOTrainer, trl.GRPOConfig)):
        caplog.clear()
        extra = dict(advantage_eps=1e-4) if cls is trl_ext.GRPOTrainer else {}
        with caplog.at_level("WARNING", logger="trl_ext"):
            trainer = make_trainer(cls, config, tiny_model_dir, tokenizer, tmp_path, **shared, **extra)
            inputs = perturb_for_clipping(generation_batch(trainer))
        if cls is trl_ext.GRPOTrainer:
            # generation still shares its prompt cache; the log-prob forwards and the row skipping are off, in 1 line
            assert trainer._share_prompts and not trainer._pack and not trainer._skip_zero_advantage
            said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trl_ext speed savings")]
            assert len(said) == 1, said
            reason = "top_entropy_quantile=0.3 keeps the tokens above a quantile of the whole batch's entropies"
            assert f"skip_zero_advantage_rows off: {reason}" in said[0], said
            assert f"share_prompt_cache and pack_completions in the log-prob forwards off: {reason}" in said[0], said
        lengths = inputs["completion_mask"].sum(1)
        assert lengths.min() < lengths.max()  # ragged
        inputs["advantages"] = torch.tensor([0.0, 1.5, 0.0, -0.5])
        record = []
        recording_entropies(trainer, record)
        trainer.accelerator.gradient_state._set_sync_gradients(True)  # the optimizer step's last micro-batch
        runs[cls] = inputs, record, *loss_and_grads(trainer, dict(inputs))
    (batch, ours, loss, grads), (ref_batch, theirs, ref_loss, ref_grads) = (
        runs[trl_ext.GRPOTrainer],
        runs[trl.GRPOTrainer],
    )
    # same sampled completions (generation shared its prompt cache); the old log-probs perturbed alike
    assert torch.equal(batch["completion_ids"], ref_batch["completion_ids"])
    torch.testing.assert_close(batch["old_per_token_logps"], ref_batch["old_per_token_logps"], atol=1e-6, rtol=0)
    assert len(ours) == len(theirs) == 1
    (entropies, mask, kept), (ref_entropies, ref_mask, ref_kept) = ours[0], theirs[0]
    assert torch.equal(mask, ref_mask) and torch.equal(entropies[mask.bool()], ref_entropies[ref_mask.bool()])
    assert torch.equal(kept, ref_kept) and 0 < kept.sum() < mask.sum()
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    assert loss != 0
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-4, msg=name)


BATCH_WIDE = {  # the entropy-dependent options, each with checkpointing off and on
    "top_entropy_quantile": dict(top_entropy_quantile=0.3),
    "top_entropy_quantile+entropy_coef": dict(top_entropy_quantile=0.3, entropy_coef=0.5),
    "entropy_coef": dict(entropy_coef=0.5),
    "use_adaptive_entropy": dict(
        use_adaptive_entropy=True, entropy_coef=0.2, entropy_coef_delta=0.3, entropy_coef_max=0.7, entropy_target=50.0
    ),
    "off_policy_mask_threshold": dict(off_policy_mask_threshold=1e-3),
}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("option", list(BATCH_WIDE))
def test_entropy_dependent_options_train_as_upstream_with_every_saving_setting(
    option, checkpointing, tokenizer, tiny_model_dir, tmp_path
):
    """An unchanged trl.GRPOConfig with each entropy-dependent option (bnpo, steps_per_generation 2: 2 optimizer steps
    from one generation batch, the second off-policy) trains trl_ext.GRPOTrainer, with its default savings, to
    upstream's weights: plain SGD (equal weights mean equal gradients; Adam's first steps move an element by +-lr
    whatever its size, so it turns last-bit gradient differences into 1e-5 weight differences that then cross the
    entropy threshold); advantages exact in float32 (scale_rewards "none"; with TRL's std scaling trl_ext's float32
    advantages differ from upstream's by a last bit, 1.5e-8, whose 4e-9 weight change moves a step-2 entropy by one
    float step across the quantile on this model: the weights then end 0.023 apart whatever the savings);
    ragged completions; one of the 2 groups ("Count to 3:") with advantages all 0. Tolerance:
    1e-6 absolute and 1e-5 relative on every weight, against an update above 1e-3 (learning rate 0.5 x gradients)."""
    settings = dict(
        COMMON,
        **TRAINING,
        **BATCH_WIDE[option],
        output_dir=str(tmp_path / option),
        loss_type="bnpo",
        scale_rewards="none",  # advantages r - group mean of integer rewards: exact in float32, upstream's bit for bit
        gradient_checkpointing=checkpointing,
        generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], 14.0]]},
    )
    # 2 groups of 4 per generation batch, one optimizer step of 4 rows each
    settings.update(
        per_device_train_batch_size=4, steps_per_generation=2, gradient_accumulation_steps=1, max_completion_length=8
    )
    logs, weights, records = {}, {}, {}
    for cls in (trl_ext.GRPOTrainer, trl.GRPOTrainer):
        trainer = cls(
            model=tiny_model_dir,
            reward_funcs=count_to_3_scores_zero,
            args=trl.GRPOConfig(**settings),
            train_dataset=toy_dataset(8),
            processing_class=copy.deepcopy(tokenizer),
        )
        if cls is trl_ext.GRPOTrainer:
            trainer.args.advantage_eps = 1e-4  # TRL hard-codes 1e-4; trl_ext's default is the course's 1e-6
        records[cls] = []
        recording_entropies(trainer, records[cls])
        torch.manual_seed(0)
        trainer.train()
        weights[cls] = dict(trainer.model.named_parameters())
        logs[cls] = [entry for entry in trainer.state.log_history if "loss" in entry]
    ours, theirs = weights[trl_ext.GRPOTrainer], weights[trl.GRPOTrainer]
    assert len(logs[trl.GRPOTrainer]) == 2 and logs[trl.GRPOTrainer][0]["frac_reward_zero_std"] == 0.5, logs
    initial = dict(trl_ext.models.load_model(tiny_model_dir).named_parameters())
    assert max((theirs[n] - initial[n]).abs().max().item() for n in theirs) > 1e-3  # the steps did train
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=1e-5, msg=name)
    # the mask acted, on the same tokens as upstream's, from a quantile of upstream's very entropies at each step
    if "top_entropy_quantile" in option:
        assert len(records[trl_ext.GRPOTrainer]) == len(records[trl.GRPOTrainer]) == 2
        for ours_call, theirs_call in zip(records[trl_ext.GRPOTrainer], records[trl.GRPOTrainer], strict=True):
            (entropies, mask, kept), (ref_entropies, ref_mask, ref_kept) = ours_call, theirs_call
            assert torch.equal(mask, ref_mask) and torch.equal(entropies[mask.bool()], ref_entropies[mask.bool()])
            assert torch.equal(kept, ref_kept) and 0 < kept.sum() < mask.sum()
