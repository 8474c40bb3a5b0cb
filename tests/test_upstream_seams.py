"""The trainers refuse a TRL whose seams or version differ from the ones trl_ext overrides
(trl_ext.trainers.upstream)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import trl

import trl_ext
from trl_ext.trainers import upstream

# (trl_ext trainer, upstream trainer, module holding its _SEAMS, how to construct it up to the check)
TRAINERS = [
    (
        trl_ext.GRPOTrainer,
        trl.GRPOTrainer,
        "trl_ext.trainers.grpo.trainer",
        lambda cls: cls(model=None, reward_funcs=None),
    ),
    (trl_ext.SFTTrainer, trl.SFTTrainer, "trl_ext.trainers.sft", lambda cls: cls(model=None)),
    (trl_ext.DPOTrainer, trl.DPOTrainer, "trl_ext.trainers.dpo", lambda cls: cls(model=None)),
    (trl_ext.RewardTrainer, trl.RewardTrainer, "trl_ext.trainers.reward", lambda cls: cls(model=None)),
]


@pytest.mark.parametrize("ours, theirs, module, build", TRAINERS, ids=lambda x: getattr(x, "__name__", ""))
def test_every_override_is_a_checked_seam(ours, theirs, module, build):
    seams = importlib.import_module(module)._SEAMS
    overridden = {
        name
        for cls in ours.__mro__[: ours.__mro__.index(theirs)]
        for name, value in vars(cls).items()
        if callable(value) and hasattr(theirs, name)
    }
    assert overridden <= set(seams), f"overridden but not checked: {overridden - set(seams)}"
    upstream.check_upstream(theirs, seams)  # the installed TRL passes


@pytest.mark.parametrize("ours, theirs, module, build", TRAINERS, ids=lambda x: getattr(x, "__name__", ""))
def test_a_missing_seam_fails_naming_it(ours, theirs, module, build, monkeypatch):
    seams = importlib.import_module(module)._SEAMS
    name = next(n for n in seams if n != "__init__" and n in vars(theirs))  # the first seam upstream defines itself
    monkeypatch.delattr(theirs, name)
    if hasattr(theirs, name):  # defined further up (transformers.Trainer): hide it there too
        monkeypatch.setattr(theirs, name, None)
    with pytest.raises(RuntimeError, match=rf"{theirs.__name__}\.{name} does not exist in trl"):
        build(ours)


def test_a_changed_signature_fails_naming_the_seam(monkeypatch):
    # what a rename of one parameter upstream looks like
    def _compute_loss(self, model, batch):
        raise AssertionError("never called")

    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", _compute_loss)
    with pytest.raises(
        RuntimeError, match=r"GRPOTrainer\._compute_loss\(model, batch\) in trl .* differs from the \(model, inputs\)"
    ):
        trl_ext.GRPOTrainer(model=None, reward_funcs=None)
    assert tuple(inspect.signature(_compute_loss).parameters)[1:] == ("model", "batch")


def test_an_untested_trl_version_fails_unless_allowed(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.delenv(upstream.ALLOW_UNTESTED_TRL_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"tested with trl 1\.16\.0, but trl 1\.17\.0 is installed"):
        trl_ext.SFTTrainer(model=None)
    monkeypatch.setenv(upstream.ALLOW_UNTESTED_TRL_ENV, "1")
    with pytest.warns(UserWarning, match="trl 1.17.0 is installed"):
        upstream.check_upstream(
            trl.SFTTrainer, {"compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch")}
        )
    # the seams are still checked when the version is allowed
    monkeypatch.delattr(trl.SFTTrainer, "_prepare_dataset")
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="_prepare_dataset does not exist"):
        trl_ext.SFTTrainer(model=None)


def test_installed_trl_is_the_pinned_one():
    assert trl.__version__ in upstream.TESTED_TRL_VERSIONS


def test_grpo_module_docstrings_list_exactly_the_upstream_methods_each_class_overrides():
    import trl

    import trl_ext.trainers.grpo.dynamic_sampling as dynamic
    import trl_ext.trainers.grpo.speed as speed
    import trl_ext.trainers.grpo.trainer as grpo
    from trl_ext.trainers.upstream import TrainerMixin

    def overrides(cls):
        return {name for name in vars(cls) if callable(getattr(trl.GRPOTrainer, name, None))}

    # the checkpoint hooks are TrainerMixin's (its __init__ too, but GRPOTrainer has its own)
    upstream_named = overrides(grpo.GRPOTrainer) - (set(vars(TrainerMixin)) - {"__init__"})
    assert upstream_named == {
        "__init__",
        "_calculate_rewards",
        "_tokenize_prompts",
        "_compute_loss",
        "training_step",
        "_generate_single_turn",  # stop strings: generation stops there, the completion is cut there
        "_generate",  # the cut completion's text, its length metrics and "cut by the length limit"
        "log",  # one warning when most completions of a window were cut
    }
    # each upstream method is overridden once in the whole chain (issue 46): the speed paths enter generation as a
    # block the trainer's one _generate_single_turn opens, dynamic sampling owns _generate_and_score_completions
    assert overrides(speed.GRPOSpeedMixin) == {"_get_per_token_logps_and_entropies"}
    chain = [grpo.GRPOTrainer, dynamic.DynamicSamplingMixin, speed.GRPOSpeedMixin]
    for name in set().union(*map(overrides, chain)) - {"__init__"}:
        assert (
            sum(name in vars(cls) for cls in grpo.GRPOTrainer.__mro__ if cls.__module__.startswith("trl_ext")) == 1
        ), name
    assert overrides(dynamic.DynamicSamplingMixin) == {"_generate_and_score_completions"}
    for name in upstream_named | overrides(dynamic.DynamicSamplingMixin):
        assert f"``{name}``" in grpo.__doc__, name
    for name in overrides(speed.GRPOSpeedMixin):
        assert f"``{name}``" in speed.__doc__ and f"``{name}``" in grpo.__doc__, name


def test_the_grouping_rule_the_recipes_check_is_upstreams():
    """``generation_grouping_problem`` (what a recipe reports before any model loads, in the flags a user typed)
    finds a problem exactly where ``trl.GRPOConfig`` itself refuses, over batch sizes, accumulation, steps per
    generation, an explicit generation batch and group sizes."""
    from trl_ext.trainers.grpo.trainer import generation_grouping_problem

    checked = refused = 0
    for batch in (1, 2, 3, 4, 6):
        for accumulation in (1, 2, 3):
            for steps, generation_batch in ((None, None), (2, None), (3, None), (None, 12), (None, 24)):
                if generation_batch is not None and generation_batch % batch:
                    continue  # upstream's other rule (a whole number of batches), not the grouping one
                for group in (2, 3, 4, 8):
                    values = dict(
                        per_device_train_batch_size=batch,
                        gradient_accumulation_steps=accumulation,
                        steps_per_generation=steps,
                        generation_batch_size=generation_batch,
                        num_generations=group,
                    )
                    try:
                        trl.GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, **values)
                        upstream_refuses = False
                    except ValueError as err:
                        upstream_refuses = "num_generations" in str(err)
                    assert (generation_grouping_problem(values) is not None) == upstream_refuses, values
                    checked, refused = checked + 1, refused + upstream_refuses
    assert checked > 200 and 0 < refused < checked
    assert generation_grouping_problem(
        dict(
            per_device_train_batch_size=16, gradient_accumulation_steps=1, steps_per_generation=None, num_generations=3
        )
    ) == (
        "--num_generations 3 must divide the completions generated per step, 16 = --per_device_train_batch_size 16 "
        "x 1 process(es) x --gradient_accumulation_steps 1; change --num_generations or --per_device_train_batch_size"
    )
