"""Every GRPO option of TRL 1.16 that changes the objective, given to trl_ext.GRPOTrainer in an otherwise unchanged
``trl.GRPOConfig``, trains as upstream ``trl.GRPOTrainer`` (issue 39): ``loss_type`` cispo, sapo, luspo, vespo;
``importance_sampling_level="sequence"`` (GSPO); ``delta``; ``epsilon_high`` (clip-higher); ``scale_rewards="batch"``;
``multi_objective_aggregation="normalize_then_sum"``. Also how each TRL name maps onto trl_ext's registered choices
(either name decides, both given must agree) and that upstream's own warnings and errors about their combinations
come out unchanged.

The training runs are ``test_grpo_trainer.test_upstream_default_token_means_train_as_upstream_with_accumulation``'s:
one generation batch of 8 completions (steps_per_generation 4) feeds 2 optimizer steps of 2 accumulated micro-batches
of 2, so the second step's micro-batches are trained off-policy (token ratios 0.88-1.2 here; the clip cases use
epsilon 0.01 or 0.02 so that clipping binds on some tokens, which each case checks: a run without the option ends
elsewhere); plain SGD, so equal weights mean equal gradients. Rewards are integers (character length mod 5, and
spaces mod 3), whose group and batch means are exact in float32: trl_ext's all-equal rule (exactly 0) and upstream's
arithmetic (r - mean = 0) agree, and ``from_upstream`` sets upstream's eps 1e-4, so the advantages agree up to
float32-vs-float64 rounding. tests/test_distributed_upstream_options.py runs the options whose normalization spans
processes on two.
"""

import copy
import dataclasses
import logging

import pytest
import torch
import trl
from conftest import length_mod5_reward
from datasets import Dataset
from tiny import GRPO_OFF_POLICY, count_prompts, save_tiny_model

import trl_ext
from trl_ext.rewards import completion_text


def spaces_mod3_reward(completions, **kwargs) -> list[float]:
    """A second integer reward, unlike the first: the number of spaces modulo 3."""
    return [float(completion_text(c).count(" ") % 3) for c in completions]


BASE = GRPO_OFF_POLICY
ONE_REWARD, TWO_REWARDS = (length_mod5_reward,), (length_mod5_reward, spaces_mod3_reward)

# option -> (its settings, the reward functions, the run without it, the metrics upstream logs for it, what trl_ext
# resolves it to: pg_loss_type, length_normalization, advantage_estimator)
CASES = {
    # CISPO clips the ratio at epsilon_high itself: 1.05 clips the off-policy step's ratios above 1.05 (up to 1.075
    # here). Not 1.0: the on-policy ratios are exactly 1 in upstream's padded forwards, and 1 +- 5e-7 in trl_ext's
    # shared, packed ones (the old log-probs' forward packs other rows than the training micro-batch's, which TRL
    # shuffles), so a bound at exactly 1 counts a token as clipped in one and not the other (cispo_clip_ratio 1/24
    # against 0 in the first step) while the weights agree to 1.2e-7: a tie in the metric, not a different update
    "cispo": (dict(loss_type="cispo", epsilon_high=1.05), ONE_REWARD, "dapo", ("cispo_clip_ratio",), "cispo"),
    "sapo": (dict(loss_type="sapo"), ONE_REWARD, "dapo", (), "sapo"),
    "luspo": (
        dict(loss_type="luspo", importance_sampling_level="sequence"),
        ONE_REWARD,
        "dapo",
        ("clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max"),
        "grpo_clip",
    ),
    "vespo": (dict(loss_type="vespo"), ONE_REWARD, "dapo", ("vespo/phi_seq_mean",), "vespo"),
    # GSPO as its paper sets it (loss_type grpo), with a KL term whose bias correction takes the sequence ratio
    "gspo": (
        dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.02, beta=0.04),
        ONE_REWARD,
        "tight_grpo_kl",
        ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/low_min", "clip_ratio/high_max", "kl"),
        "grpo_clip",
    ),
    "delta": (
        dict(epsilon=0.01, delta=1.02),
        ONE_REWARD,
        "tight",
        ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"),
        "grpo_clip",
    ),
    "epsilon_high": (
        dict(epsilon=0.01, epsilon_high=0.3),
        ONE_REWARD,
        "tight",
        ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/high_max"),
        "grpo_clip",
    ),
    "batch_std": (dict(scale_rewards="batch"), ONE_REWARD, "dapo", (), "grpo_clip"),
    "normalize_then_sum": (
        dict(multi_objective_aggregation="normalize_then_sum"),
        TWO_REWARDS,
        "dapo_two_rewards",
        (),
        "grpo_clip",
    ),
}
WITHOUT = {  # the runs without an option, each shared by the cases that name it
    "dapo": (dict(), ONE_REWARD),
    "dapo_two_rewards": (dict(), TWO_REWARDS),
    "tight": (dict(epsilon=0.01), ONE_REWARD),
    "tight_grpo_kl": (dict(loss_type="grpo", epsilon=0.02, beta=0.04), ONE_REWARD),
}
RESOLVED = {  # option -> (length_normalization, advantage_estimator) trl_ext resolves it to
    "cispo": ("token_mean", "group_normalized"),
    "sapo": ("masked_mean", "group_normalized"),
    "luspo": ("masked_sum", "group_normalized"),
    "vespo": ("token_mean", "group_normalized"),
    "gspo": ("masked_mean", "group_normalized"),
    "delta": ("token_mean", "group_normalized"),
    "epsilon_high": ("token_mean", "group_normalized"),
    "batch_std": ("token_mean", "batch_std"),
    "normalize_then_sum": ("token_mean", "normalize_then_sum"),
}


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(tokenizer, path, seed=0)
    return str(path)


def train(trainer_cls, tokenizer, model_dir, output_dir, reward_funcs, option, prepare=None):
    """2 optimizer steps from an upstream config with ``option``: the trainer's config, weights and logs.
    ``prepare(trainer)``, when given, runs between building the trainer and training it."""
    tok = copy.deepcopy(tokenizer)
    settings = dict(BASE, output_dir=str(output_dir), **option)
    settings["generation_kwargs"] = {"sequence_bias": [[[tok.eos_token_id], 14.0]]}  # ends ~1 token in 5
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=list(reward_funcs),
        args=trl.GRPOConfig(**settings),
        train_dataset=count_prompts(8),
        processing_class=tok,
    )
    if prepare is not None:
        prepare(trainer)
    torch.manual_seed(0)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer.args, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, logs


@pytest.fixture(scope="module")
def without_runs(tokenizer, model_dir, tmp_path_factory):
    """Upstream's weights without each option, trained once for the module (on first use)."""
    runs = {}

    def get(name):
        if name not in runs:
            option, reward_funcs = WITHOUT[name]
            out = tmp_path_factory.mktemp(f"without-{name}")
            runs[name] = train(trl.GRPOTrainer, tokenizer, model_dir, out, reward_funcs, option)[1]
        return runs[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_each_trl_option_trains_as_upstream_with_accumulation(name, tokenizer, model_dir, without_runs, tmp_path):
    option, reward_funcs, without, metrics, pg_loss_type = CASES[name]
    args, ours, our_logs = train(trl_ext.GRPOTrainer, tokenizer, model_dir, tmp_path / "ours", reward_funcs, option)
    _, theirs, their_logs = train(trl.GRPOTrainer, tokenizer, model_dir, tmp_path / "theirs", reward_funcs, option)
    # trl_ext resolved the option onto its registered choices, and kept upstream's values of the shared fields
    assert (args.pg_loss_type, args.length_normalization, args.advantage_estimator) == (pg_loss_type, *RESOLVED[name])
    assert args.advantage_eps == 1e-4
    for key, value in option.items():
        assert getattr(args, key) == value, key
    # same losses, metrics (every one upstream logs: loss, grad_norm, rewards, entropy, clip ratios, the option's own)
    # and weights after 2 optimizer steps
    assert len(our_logs) == len(their_logs) == 2
    for ours_logged, theirs_logged in zip(our_logs, their_logs, strict=True):
        assert set(metrics) <= theirs_logged.keys() <= ours_logged.keys() | {"step_time"}
        for key in theirs_logged.keys() - {"step_time"}:
            assert ours_logged[key] == pytest.approx(theirs_logged[key], abs=1e-6, rel=1e-5), key
    for param in theirs:
        torch.testing.assert_close(ours[param], theirs[param], atol=1e-6, rtol=1e-5)
    # the option took effect: upstream without it ends elsewhere, by far more than the tolerance
    reference = without_runs(without)
    assert max((reference[n] - theirs[n]).abs().max().item() for n in theirs) > 100 * 1e-6
    # the off-policy micro-batches had ratios away from 1, so the clips had something to clip
    assert max(max(e["ratio/max"] - 1, 1 - e["ratio/min"]) for e in our_logs) > 0.03
    if name in ("gspo", "delta", "epsilon_high"):
        assert max(e["clip_ratio/low_mean"] + e["clip_ratio/high_mean"] for e in our_logs) > 0
    if name == "cispo":  # the bound clipped some token, off-policy only
        assert our_logs[0]["cispo_clip_ratio"] == 0 and our_logs[1]["cispo_clip_ratio"] > 0


# ------------------------------------------------------------------------------------------- how the names resolve

CONFIG = dict(output_dir="unused", report_to="none", use_cpu=True)


def settings(config):
    return (
        config.pg_loss_type,
        config.length_normalization,
        config.loss_type,
        config.advantage_estimator,
        config.normalize_by_std,
        config.scale_rewards,
        config.multi_objective_aggregation,
    )


COURSE = ("grpo_clip", "masked_mean", "grpo", "group_normalized", True, "group", "sum_then_normalize")


@pytest.mark.parametrize(
    "given, expected",
    [
        # TRL's loss types: (per-token loss, length normalization)
        (dict(loss_type="grpo"), ("grpo_clip", "masked_mean", "grpo")),
        (dict(loss_type="bnpo"), ("grpo_clip", "local_token_mean", "bnpo")),
        (dict(loss_type="dr_grpo"), ("grpo_clip", "masked_normalize", "dr_grpo")),
        (dict(loss_type="dapo"), ("grpo_clip", "token_mean", "dapo")),
        (dict(loss_type="cispo"), ("cispo", "token_mean", "cispo")),
        (dict(loss_type="sapo"), ("sapo", "masked_mean", "sapo")),
        (dict(loss_type="luspo"), ("grpo_clip", "masked_sum", "luspo")),
        (dict(loss_type="vespo"), ("vespo", "token_mean", "vespo")),
        # the course names alone: a loss with a TRL name of its own brings the normalization TRL pairs it with
        (dict(pg_loss_type="cispo"), ("cispo", "token_mean", "cispo")),
        (dict(pg_loss_type="sapo"), ("sapo", "masked_mean", "sapo")),
        (dict(length_normalization="masked_sum"), ("grpo_clip", "masked_sum", "luspo")),
        # a pair TRL has no name for
        (dict(pg_loss_type="cispo", length_normalization="masked_mean"), ("cispo", "masked_mean", None)),
        # a loss type that names only a normalization keeps the loss given
        (
            dict(loss_type="dapo", pg_loss_type="reinforce_with_baseline"),
            ("reinforce_with_baseline", "token_mean", "dapo"),
        ),
        (dict(loss_type="luspo", pg_loss_type="grpo_no_clip"), ("grpo_no_clip", "masked_sum", "luspo")),
        # both names, agreeing
        (
            dict(loss_type="cispo", pg_loss_type="cispo", length_normalization="token_mean"),
            ("cispo", "token_mean", "cispo"),
        ),
    ],
)
def test_trl_loss_types_map_onto_a_loss_and_a_normalization(given, expected):
    assert settings(trl_ext.GRPOConfig(**CONFIG, **given))[:3] == expected


@pytest.mark.parametrize(
    "given, expected",
    [
        (dict(), COURSE[3:]),
        (dict(scale_rewards="batch"), ("batch_std", True, "batch", "sum_then_normalize")),
        (dict(advantage_estimator="batch_std"), ("batch_std", True, "batch", "sum_then_normalize")),
        (
            dict(multi_objective_aggregation="normalize_then_sum"),
            ("normalize_then_sum", True, "group", "normalize_then_sum"),
        ),
        # upstream's own defaults with it, as a trl.GRPOConfig passes them
        (
            dict(multi_objective_aggregation="normalize_then_sum", scale_rewards="group"),
            ("normalize_then_sum", True, "group", "normalize_then_sum"),
        ),
        (
            dict(advantage_estimator="normalize_then_sum"),
            ("normalize_then_sum", True, "group", "normalize_then_sum"),
        ),
        (
            dict(scale_rewards="none", multi_objective_aggregation="sum_then_normalize"),
            ("group_normalized", False, "none", "sum_then_normalize"),
        ),
        (dict(pg_loss_type="no_baseline"), ("raw_rewards", True, "group", "sum_then_normalize")),
    ],
)
def test_trl_advantage_options_map_onto_an_estimator(given, expected):
    assert settings(trl_ext.GRPOConfig(**CONFIG, **given))[3:] == expected


@pytest.mark.parametrize(
    "given, message",
    [
        (
            dict(loss_type="cispo", pg_loss_type="grpo_clip"),
            "loss_type='cispo' conflicts with pg_loss_type='grpo_clip': loss_type is TRL's name for pg_loss_type, and "
            "loss_type='cispo' means pg_loss_type='cispo'",
        ),
        (
            dict(loss_type="cispo", length_normalization="masked_mean"),
            "loss_type='cispo' conflicts with length_normalization='masked_mean'.*means "
            "length_normalization='token_mean'",
        ),
        (
            dict(loss_type="dapo", pg_loss_type="cispo"),
            "loss_type='dapo' conflicts with pg_loss_type='cispo': loss_type='dapo' means length_normalization="
            "'token_mean' for a loss without a TRL name, while pg_loss_type='cispo' with length_normalization="
            "'token_mean' is TRL's loss_type='cispo'",
        ),
        (
            dict(loss_type="grpo", pg_loss_type="sapo", length_normalization="masked_mean"),
            "loss_type='grpo' conflicts with pg_loss_type='sapo'",
        ),
        (
            dict(scale_rewards="batch", advantage_estimator="group_normalized"),
            "scale_rewards='batch' conflicts with advantage_estimator='group_normalized'.*means "
            "advantage_estimator='batch_std'",
        ),
        (
            dict(scale_rewards="group", advantage_estimator="batch_std"),
            "scale_rewards='group' conflicts with advantage_estimator='batch_std'.*TRL's scale_rewards='batch'",
        ),
        (
            dict(multi_objective_aggregation="sum_then_normalize", advantage_estimator="normalize_then_sum"),
            "multi_objective_aggregation='sum_then_normalize' conflicts with advantage_estimator='normalize_then_sum'",
        ),
        (
            dict(advantage_estimator="batch_std", normalize_by_std=False),
            "normalize_by_std=False conflicts with advantage_estimator='batch_std', which always divides by a std",
        ),
        (
            dict(pg_loss_type="no_baseline", scale_rewards="batch"),
            "scale_rewards='batch' \\(advantage_estimator='batch_std'\\) conflicts with pg_loss_type='no_baseline'",
        ),
        (
            dict(advantage_estimator="batch_std", dynamic_sampling=True),
            "dynamic_sampling=True with advantage_estimator='batch_std'",
        ),
    ],
)
def test_both_names_given_differently_raise_naming_both(given, message):
    with pytest.raises(ValueError, match=message):
        trl_ext.GRPOConfig(**CONFIG, **given)


def test_derived_names_are_derived_again_after_replace():
    def replace(config, **changes):
        return dataclasses.replace(config, generation_batch_size=None, **changes)

    course = trl_ext.GRPOConfig(**CONFIG)
    cispo = replace(course, loss_type="cispo")
    assert settings(cispo)[:3] == ("cispo", "token_mean", "cispo")
    # cispo's loss and normalization were derived: another loss type re-derives both
    assert settings(replace(cispo, loss_type="sapo"))[:3] == ("sapo", "masked_mean", "sapo")
    assert settings(replace(cispo, loss_type="dapo"))[:3] == ("grpo_clip", "token_mean", "dapo")
    assert settings(replace(course, scale_rewards="batch"))[3:] == ("batch_std", True, "batch", "sum_then_normalize")
    gdpo = replace(course, multi_objective_aggregation="normalize_then_sum")
    assert settings(replace(gdpo, multi_objective_aggregation="sum_then_normalize")) == COURSE


def test_from_upstream_takes_trls_eps_and_the_course_keeps_its_own(tmp_path):
    from transformers import TrainingArguments

    upstream = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, scale_rewards="batch")
    assert trl_ext.GRPOConfig.from_upstream(upstream).advantage_eps == 1e-4  # TRL hard-codes 1e-4
    plain = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert trl_ext.GRPOConfig.from_upstream(plain).advantage_eps == 1e-6  # the course's defaults
    assert trl_ext.GRPOConfig(**CONFIG, scale_rewards="batch").advantage_eps == 1e-6  # the name picks the formula


# ------------------------------------------------------------------------------ upstream's own checks, unchanged


@pytest.mark.parametrize(
    "option, warning",
    [
        (
            dict(loss_type="luspo"),
            "When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'`",
        ),
        (dict(loss_type="vespo", importance_sampling_level="sequence"), "VESPO computes sequence-level importance"),
        (
            dict(loss_type="cispo", importance_sampling_level="sequence"),
            "When using `importance_sampling_level='sequence'`, the `'cispo'` loss sums per-token",
        ),
    ],
)
def test_upstreams_warnings_about_combinations_come_out_unchanged(
    option, warning, tokenizer, model_dir, tmp_path, caplog
):
    logged = {}
    for cls in (trl.GRPOTrainer, trl_ext.GRPOTrainer):
        caplog.clear()
        args = trl.GRPOConfig(**dict(BASE, output_dir=str(tmp_path / cls.__module__), **option))
        with caplog.at_level(logging.WARNING):
            cls(
                model=model_dir,
                reward_funcs=length_mod5_reward,
                args=args,
                train_dataset=Dataset.from_dict({"prompt": ["Count to 3:"] * 8}),
                processing_class=copy.deepcopy(tokenizer),
            )
        logged[cls] = [r.getMessage() for r in caplog.records if warning in r.getMessage()]
    assert len(logged[trl.GRPOTrainer]) == 1 and logged[trl_ext.GRPOTrainer] == logged[trl.GRPOTrainer]


def test_vespo_refuses_a_sequence_level_vllm_correction_as_upstream(tokenizer, model_dir, tmp_path):
    message = (
        "VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or 'token_mask'. Got: "
        "sequence_mask."
    )
    args = trl.GRPOConfig(
        **dict(BASE, output_dir=str(tmp_path), loss_type="vespo", use_vllm=True),
        vllm_importance_sampling_mode="sequence_mask",
    )
    for cls in (trl.GRPOTrainer, trl_ext.GRPOTrainer):
        with pytest.raises(ValueError) as err:
            cls(
                model=model_dir,
                reward_funcs=length_mod5_reward,
                args=args,
                train_dataset=Dataset.from_dict({"prompt": ["Count to 3:"] * 8}),
                processing_class=copy.deepcopy(tokenizer),
            )
        assert str(err.value) == message
