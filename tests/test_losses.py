"""The registered choices of GRPO's objective: policy losses in verl's shape (trl_ext.objective.losses), length
normalizations (trl_ext.objective.aggregations) and advantage estimators (trl_ext.objective.advantages) -- each entry
keeps what it declares, the built-ins give the course's numbers, and a user's own loads by package.module:attr."""

import dataclasses
import inspect
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch
import trl

import trl_ext
from trl_ext import functional
from trl_ext.objective import advantages, aggregations, losses

# ------------------------------------------------------------------------------------------- the built-in entries


def test_the_builtin_registry_entries():
    assert list(losses.POLICY_LOSSES) == [
        "no_baseline",
        "reinforce_with_baseline",
        "grpo_clip",
        "grpo_no_clip",
        "cispo",
        "sapo",
        "vespo",
    ]
    assert [name for name, e in losses.POLICY_LOSSES.items() if not e.uses_old_log_probs] == [
        "no_baseline",
        "reinforce_with_baseline",
    ]
    assert losses.POLICY_LOSSES.get("no_baseline").advantage_estimator == "raw_rewards"
    assert [name for name, e in losses.POLICY_LOSSES.items() if e.advantage_estimator] == ["no_baseline"]
    assert losses.POLICY_LOSSES.get("grpo_clip").options == (
        "epsilon",
        "epsilon_high",
        "delta",
        "importance_sampling_level",
    )
    # TRL's loss types with a per-token objective of their own, and the normalization TRL pairs each with
    claims = {e.upstream_loss_type: (n, e.length_normalization) for n, e in losses.POLICY_LOSSES.items()}
    claims.pop(None)
    assert claims == {
        "cispo": ("cispo", "token_mean"),
        "sapo": ("sapo", "masked_mean"),
        "vespo": ("vespo", "token_mean"),
    }
    assert [name for name, e in losses.POLICY_LOSSES.items() if e.takes_sampling_ratio] == ["vespo"]
    assert aggregations.upstream_loss_types() == {
        "grpo": "masked_mean",
        "dr_grpo": "masked_normalize",
        "luspo": "masked_sum",
        "dapo": "token_mean",
        "bnpo": "local_token_mean",
    }
    assert list(advantages.ADVANTAGE_ESTIMATORS) == [
        "group_normalized",
        "raw_rewards",
        "batch_std",
        "normalize_then_sum",
    ]
    assert [n for n, e in advantages.ADVANTAGE_ESTIMATORS.items() if e.spans_groups] == [
        "batch_std",
        "normalize_then_sum",
    ]
    with pytest.raises(ValueError, match="pg_loss_type='ppo' is not supported: no such policy loss; expected one of "):
        losses.POLICY_LOSSES.get("ppo")
    # another function under a built-in's name is refused, naming both (the same definition again would replace it:
    # tests/test_registry_reimport.py)
    with pytest.raises(ValueError) as refused:
        losses.POLICY_LOSSES.register(
            "grpo_clip", dataclasses.replace(losses.POLICY_LOSSES.get("grpo_clip"), fn=lambda *a: None)
        )
    first_line = inspect.getsourcelines(losses.grpo_clip)[1]  # its decorator's line
    assert str(refused.value).startswith(
        f"a policy loss named 'grpo_clip' is already registered: trl_ext.objective.losses:grpo_clip (registered at "
        f"{losses.__file__}:{first_line}); test_losses:test_the_builtin_registry_entries.<locals>.<lambda> "
        f"(registered at {__file__}:"
    )
    with pytest.raises(ValueError, match="loss_type 'dapo' already means 'token_mean'"):
        aggregations.AGGREGATIONS.register(
            "token_sum", aggregations.Aggregation("token_sum", lambda *a: a[0].sum(), upstream_loss_type="dapo")
        )
    with pytest.raises(
        ValueError, match="reads options \\['epsilon_low'\\], which trl_ext.objective.losses.LossConfig does"
    ):
        losses.register_policy_loss("clip_low", options=("epsilon_low",))(lambda *a: None)
    with pytest.raises(ValueError, match="expected a trl_ext.objective.losses.PolicyLoss, got function"):
        losses.POLICY_LOSSES.register("bare", lambda *a: None)
    assert "clip_low" not in losses.POLICY_LOSSES and "token_sum" not in aggregations.AGGREGATIONS


def test_loss_config_holds_trl_defaults():
    """The options a loss reads default, in the course functions, to what trl.GRPOConfig (and so the trainer)
    defaults them to."""
    upstream = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    for f in dataclasses.fields(losses.LossConfig):
        assert f.name in upstream and upstream[f.name] == f.default, f.name
    trainer_fields = {f.name for f in dataclasses.fields(trl_ext.GRPOConfig)}
    for name, entry in losses.POLICY_LOSSES.items():
        assert set(entry.options) <= set(losses.LOSS_OPTIONS) <= trainer_fields, name


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(4, 5, generator=g) * 3).requires_grad_()
    old = logp.detach() + (torch.rand(4, 5, generator=g) - 0.5)  # ratios away from 1, some clipped
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    return logp, old, mask


@pytest.mark.parametrize("name", list(losses.POLICY_LOSSES))
def test_each_loss_keeps_what_its_entry_declares(name):
    """What the trainer and the speed paths rely on, checked on each entry, called as the trainer calls it: a rollout
    of advantage 0 has loss 0 and gradient 0 at every token (zero_advantage_zero_gradient); the loss reads the old
    log-probs iff it says so; its metrics are detached (B, T) or (B, 1) tensors."""
    entry = losses.POLICY_LOSSES.get(name)
    logp, old, mask = _batch()
    advantage = torch.tensor([[0.0], [1.5], [0.0], [-0.7]])
    # CISPO bounds the ratio by epsilon_high itself (TRL's reading; None: epsilon = 0.2, which caps every ratio near 1
    # at 0.2, so the old log-probs would not show): ScaleRL's recommended 5.0
    config = losses.LossConfig(epsilon_high=5.0) if name == "cispo" else losses.LossConfig()
    loss, metrics = losses.policy_loss(name, logp, old, advantage, mask, config)
    assert loss.shape == (4, 5)
    (loss * mask).sum().backward()
    if entry.zero_advantage_zero_gradient:
        assert torch.equal(loss[[0, 2]].detach(), torch.zeros(2, 5))
        assert torch.equal(logp.grad[[0, 2]], torch.zeros(2, 5))
    assert (logp.grad[[1, 3]] != 0).any(dim=1).all()  # a weighted rollout does learn (clipped tokens may not)
    moved, _ = losses.policy_loss(name, logp, old - 0.3, advantage, mask, config)
    assert (not torch.equal(moved, loss)) == entry.uses_old_log_probs
    for key, value in metrics.items():
        assert value.shape in ((4, 5), (4, 1)) and not value.requires_grad, key
    if "clipped" in metrics:
        assert metrics["clipped"].dtype == torch.bool


def test_the_verl_shape_gives_the_course_numbers_by_hand():
    # one rollout, two tokens: log p = -0.5, -1.0; old = -1.0, -1.0; A = 2; epsilon 0.2
    logp = torch.tensor([[-0.5, -1.0]])
    old = torch.tensor([[-1.0, -1.0]])
    mask = torch.ones(1, 2)
    a = torch.tensor([[2.0]])
    config = losses.LossConfig(epsilon=0.2)
    r = math.exp(0.5)  # ratio of the first token, 1.6487: clipped at 1.2 for A > 0
    clip, meta = losses.policy_loss("grpo_clip", logp, old, a, mask, config)
    assert clip[0].tolist() == pytest.approx([-2 * 1.2, -2 * 1.0])
    assert meta["clipped"].tolist() == [[True, False]] and meta["ratio"][0].tolist() == pytest.approx([r, 1.0])
    no_clip, _ = losses.policy_loss("grpo_no_clip", logp, old, a, mask, config)
    assert no_clip[0].tolist() == pytest.approx([-2 * r, -2.0])
    for name in ("no_baseline", "reinforce_with_baseline"):  # -A log p, whatever the old log-probs
        assert losses.policy_loss(name, logp, old, a, mask, config)[0].tolist() == [[1.0, 2.0]]
    # the course's dispatch reaches the same entries with its own arguments
    course, _ = losses.compute_policy_gradient_loss(logp, "grpo_clip", advantages=a, old_log_probs=old, cliprange=0.2)
    assert torch.equal(course, clip)
    assert losses.compute_policy_gradient_loss(logp, "no_baseline", raw_rewards=a)[0].tolist() == [[1.0, 2.0]]


def test_policy_loss_checks_what_goes_in_and_what_comes_out():
    logp, old, mask = _batch()
    a = torch.ones(4, 1)
    config = losses.LossConfig()
    with pytest.raises(ValueError, match=r"log_probs has shape \(4, 5\) but old_log_probs has shape \(4, 4\)"):
        losses.policy_loss("grpo_clip", logp, old[:, :4], a, mask, config)
    with pytest.raises(ValueError, match=r"log_probs has shape \(4, 5\) but response_mask has shape \(4, 4\)"):
        losses.policy_loss("grpo_clip", logp, old, a, mask[:, :4], config)
    with pytest.raises(ValueError, match=r"advantages has shape \(3, 1\); expected \(4, 1\)"):
        losses.policy_loss("grpo_clip", logp, old, a[:3], mask, config)
    # (B,) advantages are one per row too
    one_d, _ = losses.policy_loss("reinforce_with_baseline", logp, old, torch.ones(4), mask, config)
    assert torch.equal(one_d, -logp.detach())
    wrong = losses.PolicyLoss("sums", lambda lp, o, adv, m, c: ((-adv * lp).sum(), {}))
    with pytest.raises(ValueError, match=r"policy loss 'sums' returned a loss of shape \(\); expected \(4, 5\) per"):
        losses.policy_loss(wrong, logp, old, a, mask, config)


def test_a_sequence_level_loss_is_broadcast_over_its_tokens():
    """A (B, 1) loss (one value per sequence, as GSPO's sequence-level ratio gives) weighs every token of its row the
    same once broadcast: with masked_mean the row's loss is that value, with token_mean it counts once per token."""

    def sequence_reinforce(log_probs, old_log_probs, advantages, response_mask, config):
        mean_logp = (log_probs * response_mask).sum(-1, keepdim=True) / response_mask.sum(-1, keepdim=True)
        return -advantages * mean_logp, {"seq_logp": mean_logp.detach()}

    logp = torch.tensor([[-1.0, -3.0, -9.0], [-2.0, -2.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    a = torch.tensor([[1.0], [-1.0]])
    loss, metrics = losses.policy_loss(
        losses.PolicyLoss("seq", sequence_reinforce), logp, logp.detach(), a, mask, losses.LossConfig()
    )
    assert loss.tolist() == [[2.0, 2.0, 2.0], [-2.0, -2.0, -2.0]] and metrics["seq_logp"].shape == (2, 1)
    assert aggregations.compute_grpo_loss(loss, mask, "masked_mean").item() == pytest.approx(0.0)  # (2 - 2) / 2
    assert aggregations.compute_grpo_loss(loss, mask, "token_mean").item() == pytest.approx((2 * 2 - 2 * 3) / 5)


# ------------------------------------------------------------------------------------------- advantage estimators


def test_the_estimators_by_hand():
    # two groups of two rollouts, two reward functions weighted 1 and 0.5
    per_func = torch.tensor([[1.0, 0.0], [0.0, 0.0], [math.nan, math.nan], [2.0, 2.0]])
    weights = torch.tensor([1.0, 0.5])
    rewards, terms = advantages.weighted_rewards(per_func, weights)
    assert rewards[[0, 1, 3]].tolist() == [1.0, 0.0, 3.0] and math.isnan(rewards[2])  # unscorable: NaN
    assert terms[3].tolist() == [2.0, 1.0]
    config = SimpleNamespace(advantage_eps=1e-6, normalize_by_std=True)
    group = advantages.ADVANTAGE_ESTIMATORS.get("group_normalized").fn(per_func, weights, 2, config)
    # group 1: mean 0.5, unbiased std sqrt(0.5); group 2: one valid reward -> all 0
    half = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert group.tolist() == pytest.approx([half, -half, 0.0, 0.0]) and group.dtype == torch.float32
    centred = advantages.ADVANTAGE_ESTIMATORS.get("group_normalized").fn(
        per_func, weights, 2, SimpleNamespace(advantage_eps=1e-6, normalize_by_std=False)
    )
    assert centred.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    raw = advantages.ADVANTAGE_ESTIMATORS.get("raw_rewards").fn(per_func, weights, 2, config)
    assert raw.tolist() == [1.0, 0.0, 0.0, 3.0]  # the reward itself, unscorable as 0
    with pytest.raises(ValueError, match=r"expected \(N, K\) and \(K,\)"):
        advantages.weighted_rewards(per_func, torch.ones(3))


def test_the_config_chooses_the_estimator_apart_from_the_loss(tmp_path):
    base = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert trl_ext.GRPOConfig(**base).advantage_estimator == "group_normalized"
    assert trl_ext.GRPOConfig(**base, pg_loss_type="no_baseline").advantage_estimator == "raw_rewards"
    # a loss that does not fix its estimator takes any: raw-reward weighting is an advantage choice
    assert trl_ext.GRPOConfig(**base, advantage_estimator="raw_rewards").pg_loss_type == "grpo_clip"
    assert trl_ext.GRPOConfig(**base, pg_loss_type="no_baseline", advantage_estimator="raw_rewards")
    with pytest.raises(
        ValueError,
        match="advantage_estimator='group_normalized' conflicts with pg_loss_type='no_baseline', a loss defined with "
        "advantage_estimator='raw_rewards'",
    ):
        trl_ext.GRPOConfig(**base, pg_loss_type="no_baseline", advantage_estimator="group_normalized")
    with pytest.raises(ValueError, match=r"advantage_estimator='group_norm' is not supported: .*did you mean"):
        trl_ext.GRPOConfig(**base, advantage_estimator="group_norm")
    # a derived value is re-derived when the loss changes (dataclasses.replace passes every field again)
    derived = trl_ext.GRPOConfig(**base, pg_loss_type="no_baseline")
    assert dataclasses.replace(derived, pg_loss_type="grpo_clip", generation_batch_size=None).advantage_estimator == (
        "group_normalized"
    )


# ------------------------------------------------------------------------------------------- a user's own, by name


@pytest.fixture
def user_losses(tmp_path, monkeypatch):
    """A user's module ``my_rl`` with a bare loss function, a decorated one, a reduction and an estimator."""
    (tmp_path / "my_rl.py").write_text(
        textwrap.dedent(
            '''
            from trl_ext import losses

            def half_reinforce(log_probs, old_log_probs, advantages, response_mask, config):
                """-A log p / 2"""
                return -advantages * log_probs / 2, {"half": advantages.expand_as(log_probs) / 2}

            @losses.register_policy_loss("my_clip", uses_old_log_probs=True, zero_advantage_zero_gradient=True)
            def my_clip(log_probs, old_log_probs, advantages, response_mask, config):
                return losses.grpo_clip(log_probs, old_log_probs, advantages, response_mask, config)

            def row_sum(per_token_loss, response_mask, normalize_constant, empty_rows):
                """sum over every token"""
                return (per_token_loss * response_mask).sum()

            def sign(rewards_per_func, reward_weights, group_size, config):
                return rewards_per_func.sum(dim=1).sign()
            '''
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rl"
    if "my_clip" in losses.POLICY_LOSSES:
        losses.POLICY_LOSSES.unregister("my_clip")


def test_a_users_loss_aggregation_and_estimator_load_by_dotted_path(user_losses, tmp_path):
    bare = losses.POLICY_LOSSES.get("my_rl:half_reinforce")
    # a bare function declares nothing: on-policy only, every row's backward run, any estimator
    assert (bare.name, bare.formula, bare.uses_old_log_probs, bare.zero_advantage_zero_gradient) == (
        "my_rl:half_reinforce",
        "-A log p / 2",
        False,
        False,
    )
    logp = torch.tensor([[-1.0, -2.0]])
    four = torch.tensor([[4.0]])
    loss, metrics = losses.policy_loss("my_rl:half_reinforce", logp, logp, four, torch.ones(1, 2), None)
    assert loss.tolist() == [[2.0, 4.0]] and metrics["half"].tolist() == [[2.0, 2.0]]
    # a decorated function is found with its declarations (importing the module registered it)
    assert losses.POLICY_LOSSES.get("my_rl:my_clip") is losses.POLICY_LOSSES.get("my_clip")
    assert losses.POLICY_LOSSES.get("my_clip").uses_old_log_probs
    base = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert trl_ext.GRPOConfig(**base, pg_loss_type="my_rl:half_reinforce").pg_loss_type == "my_rl:half_reinforce"
    with pytest.raises(ValueError, match="pg_loss_type='my_rl:half_reinforce' is an on-policy loss"):
        trl_ext.GRPOConfig(**base, pg_loss_type="my_rl:half_reinforce", num_iterations=2)
    assert trl_ext.GRPOConfig(**base, pg_loss_type="my_rl:my_clip", num_iterations=2).num_iterations == 2
    with pytest.raises(ValueError, match="my_rl has no attribute 'nope'"):
        trl_ext.GRPOConfig(**base, pg_loss_type="my_rl:nope")
    # aggregations and estimators the same way
    assert aggregations.compute_grpo_loss(torch.ones(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]]), "my_rl:row_sum") == 3
    config = trl_ext.GRPOConfig(**base, length_normalization="my_rl:row_sum", advantage_estimator="my_rl:sign")
    assert aggregations.AGGREGATIONS.get(config.length_normalization).divisor == "none"
    sign = advantages.ADVANTAGE_ESTIMATORS.get(config.advantage_estimator)
    assert sign.fn(torch.tensor([[-2.0], [3.0]]), torch.ones(1), 2, config).tolist() == [-1.0, 1.0]


def test_help_lists_what_is_registered_when_it_is_read():
    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(trl_ext.GRPOConfig)}
    assert "'grpo_clip' (-min(ratio*A" in str(help_text["pg_loss_type"])
    assert "'later_loss'" not in str(help_text["pg_loss_type"])
    losses.register_policy_loss("later_loss", formula="-A log p, registered after import")(lambda *a: None)
    aggregations.register_aggregation("later_sum", formula="a sum", upstream_loss_type="later")(lambda *a: None)
    try:
        assert "'later_loss' (-A log p, registered after import)" in str(help_text["pg_loss_type"])
        assert "'later_sum' (a sum)" in str(help_text["length_normalization"])
        assert "'later' -> 'later_sum'" in str(help_text["loss_type"])
    finally:
        losses.POLICY_LOSSES.unregister("later_loss")
        aggregations.AGGREGATIONS.unregister("later_sum")
    assert "later" not in str(help_text["pg_loss_type"]) + str(help_text["loss_type"])
    # the pure math stays where the course reads it
    assert functional.compute_grpo_clip_loss is not None


# ------------------------------------------------------------------------------------------- TRL's options, by hand
# Each value below is worked out from the paper's formula (as TRL 1.16 computes it), not from trl_ext's code.


def _one_row(logp, old, mask=None):
    logp = torch.tensor([logp], requires_grad=True)
    old = torch.tensor([old])
    return logp, old, torch.ones_like(old) if mask is None else torch.tensor([mask], dtype=torch.float32)


def test_gspo_sequence_ratio_clips_the_whole_sequence():
    # mean log-ratio over the two response tokens: ((-0.5 + 1) + (-1 + 1.5)) / 2 = 0.5; the padding (9.0) is ignored
    logp, old, mask = _one_row([-0.5, -1.0, 9.0], [-1.0, -1.5, 0.0], [1, 1, 0])
    r = math.exp(0.5)
    ratio = functional.compute_importance_ratio(logp, old, mask, "sequence")
    assert ratio.shape == (1, 1) and ratio.item() == pytest.approx(r)
    config = losses.LossConfig(importance_sampling_level="sequence")
    # A = 2 > 0: r = 1.65 > 1.2, clipped: -1.2 * 2 on every token, no gradient
    loss, meta = losses.policy_loss("grpo_clip", logp, old, torch.tensor([[2.0]]), mask, config)
    assert loss[0].tolist() == pytest.approx([-2.4, -2.4, -2.4])
    assert meta["clipped"].tolist() == [[True]] and meta["ratio"].shape == (1, 1)
    # A = -2: min(-2r, -2.4) = -2r: loss 2r, d loss / d log p_t = 2 r / 2 for each of the 2 response tokens
    loss, meta = losses.policy_loss("grpo_clip", logp, old, torch.tensor([[-2.0]]), mask, config)
    assert loss[0, 0].item() == pytest.approx(2 * r) and meta["clipped"].tolist() == [[False]]
    loss[0, 0].backward()
    assert logp.grad[0].tolist() == pytest.approx([r, r, 0.0])
    with pytest.raises(ValueError, match="importance_sampling_level='sequence' needs response_mask"):
        functional.compute_importance_ratio(logp, old, None, "sequence")


def test_clip_higher_and_two_sided_clipping():
    # ratio exp(0.2231) = 1.25: inside DAPO's [0.8, 1.28], outside the symmetric [0.8, 1.2]
    logp, old, mask = _one_row([math.log(1.25) - 1.0], [-1.0])
    one = torch.tensor([[1.0]])
    symmetric, meta = losses.policy_loss("grpo_clip", logp, old, one, mask, losses.LossConfig())
    assert symmetric.item() == pytest.approx(-1.2) and meta["clipped"].item()
    higher, meta = losses.policy_loss("grpo_clip", logp, old, one, mask, losses.LossConfig(epsilon_high=0.28))
    assert higher.item() == pytest.approx(-1.25) and not meta["clipped"].item()
    # delta (INTELLECT-2): ratio e = 2.718 with A = -1 is bounded at delta = 1.5: loss -min(-1.5, -1.2) = 1.5, and
    # the bound takes the gradient; without delta the loss is 2.718 with gradient -A * ratio = e
    logp, old, mask = _one_row([0.0], [-1.0])
    minus = torch.tensor([[-1.0]])
    bounded, meta = losses.policy_loss("grpo_clip", logp, old, minus, mask, losses.LossConfig(delta=1.5))
    assert bounded.item() == pytest.approx(1.5) and not meta["clipped"].item()  # TRL's low clip: ratio < 0.8 only
    bounded.sum().backward()
    assert logp.grad.item() == 0.0
    logp.grad = None
    plain, _ = losses.policy_loss("grpo_clip", logp, old, minus, mask, losses.LossConfig())
    plain.sum().backward()
    assert plain.item() == pytest.approx(math.e) and logp.grad.item() == pytest.approx(math.e)


def test_cispo_weighs_reinforce_by_the_clipped_ratio():
    # ratios e^0.5 = 1.65 and 1; eps_max = epsilon_high = 1.5: weights 1.5 and 1 (no gradient through them)
    logp, old, mask = _one_row([-0.5, -1.0], [-1.0, -1.0])
    loss, meta = losses.policy_loss(
        "cispo", logp, old, torch.tensor([[2.0]]), mask, losses.LossConfig(epsilon_high=1.5)
    )
    assert loss[0].tolist() == pytest.approx([-1.5 * 2 * -0.5, -1.0 * 2 * -1.0])
    assert meta["cispo_clip_ratio"].tolist() == [[1.0, 0.0]]
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-3.0, -2.0])  # -w * A: the clipped token still learns


def test_sapo_gate_by_hand():
    # ratio 1: -(4 / tau) * sigmoid(0) * A = -2 A / tau; its gradient -4 sigmoid'(0) * ratio * A = -A (as -ratio*A)
    logp, old, mask = _one_row([-1.0, -2.0], [-1.0, -2.0 - math.log(1.5)])
    config = losses.LossConfig(sapo_temperature_pos=1.0, sapo_temperature_neg=2.0)
    loss, _ = losses.policy_loss("sapo", logp, old, torch.tensor([[3.0]]), mask, config)
    sigmoid = 1 / (1 + math.exp(-0.5))  # second token: ratio 1.5, tau 1
    assert loss[0].tolist() == pytest.approx([-4 * 0.5 * 3, -4 * sigmoid * 3])
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-3.0, -4 * sigmoid * (1 - sigmoid) * 1.5 * 3])
    # A < 0 uses sapo_temperature_neg: -(4 / 2) * sigmoid(2 * 0.5) * -1
    loss, _ = losses.policy_loss("sapo", logp, old, torch.tensor([[-1.0]]), mask, config)
    assert loss[0, 1].item() == pytest.approx(2 / (1 + math.exp(-1.0)))


def test_vespo_gamma_weight_by_hand_and_the_sampling_ratio():
    """phi(w) = exp(lambda) w^k exp(-lambda w), w the product of the response tokens' ratios (k, lambda by the sign
    of A: k_pos 2, lambda_pos 3 for A >= 0; k_neg 3, lambda_neg 2 otherwise); loss -phi * A * log p."""

    def phi(w, k, lam):
        return math.exp(lam) * w**k * math.exp(-lam * w)

    logp, old, mask = _one_row([-0.4, -1.0, -5.0], [-0.5, -1.2, 0.0], [1, 1, 0])
    w = math.exp(0.1 + 0.2)
    config = losses.LossConfig()
    loss, meta = losses.policy_loss("vespo", logp, old, torch.tensor([[2.0]]), mask, config)
    assert meta["vespo/phi_seq_mean"].item() == pytest.approx(phi(w, 2.0, 3.0), rel=1e-5)
    assert loss[0].tolist() == pytest.approx([-phi(w, 2, 3) * 2 * lp for lp in (-0.4, -1.0, -5.0)], rel=1e-5)
    negative, meta = losses.policy_loss("vespo", logp, old, torch.tensor([[-1.0]]), mask, config)
    assert meta["vespo/phi_seq_mean"].item() == pytest.approx(phi(w, 3.0, 2.0), rel=1e-5)
    # vLLM's correction: VESPO folds it into w (here x 0.8 x 0.9 x 1); every other loss is multiplied by it
    sampling = torch.tensor([[0.8, 0.9, 1.0]])
    _, meta = losses.policy_loss("vespo", logp, old, torch.tensor([[2.0]]), mask, config, sampling)
    assert meta["vespo/phi_seq_mean"].item() == pytest.approx(phi(w * 0.72, 2.0, 3.0), rel=1e-5)
    plain, _ = losses.policy_loss("reinforce_with_baseline", logp, old, torch.tensor([[2.0]]), mask, config)
    scaled, _ = losses.policy_loss("reinforce_with_baseline", logp, old, torch.tensor([[2.0]]), mask, config, sampling)
    assert torch.equal(scaled, plain * sampling)


def test_luspo_reduction_sums_each_response():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # rows: 3, 4, 0 (empty): mean over all 3 rows (TRL), or over the 2 with a response token ("drop", the trainer's)
    assert aggregations.compute_grpo_loss(per_token, mask, "masked_sum", empty_rows="zero").item() == pytest.approx(
        7 / 3
    )
    assert aggregations.compute_grpo_loss(per_token, mask, "masked_sum", empty_rows="drop").item() == pytest.approx(3.5)


def test_batch_std_and_normalize_then_sum_by_hand():
    estimator = advantages.ADVANTAGE_ESTIMATORS.get
    exact = SimpleNamespace(advantage_eps=0.0)
    # batch_std, groups of 2: rewards 0, 1 | 1, 1 -> centred -0.5, 0.5, 0, 0; std of (0, 1, 1, 1), unbiased, = 0.5
    rewards = torch.tensor([[0.0], [1.0], [1.0], [1.0]])
    assert estimator("batch_std").fn(rewards, torch.ones(1), 2, exact).tolist() == [-1.0, 1.0, 0.0, 0.0]
    eps = estimator("batch_std").fn(rewards, torch.ones(1), 2, SimpleNamespace(advantage_eps=1e-4))
    assert eps.tolist() == pytest.approx([-0.5 / 0.5001, 0.5 / 0.5001, 0.0, 0.0], rel=1e-6)
    # normalize_then_sum, weights 1 and 0.5: function 1 per group: (0, 1) -> -+1/sqrt(2), (1, 1) -> 0, 0; function 2:
    # (2, 0) -> +-1/sqrt(2), (1, 3) -> -+1/sqrt(2); sums +-(1 - 0.5)/sqrt(2) = +-a; batch: mean 0, unbiased std
    # sqrt(4 a^2 / 3), so the advantages are +-sqrt(3)/2
    per_func = torch.tensor([[0.0, 2.0], [1.0, 0.0], [1.0, 1.0], [1.0, 3.0]])
    weights = torch.tensor([1.0, 0.5])
    s = math.sqrt(3) / 2
    got = estimator("normalize_then_sum").fn(per_func, weights, 2, exact)
    assert got.tolist() == pytest.approx([-s, s, -s, s], rel=1e-6)
    # an unscorable rollout (every function None) leaves the batch mean and std and gets 0; the lone scored rollout of
    # its group gets 0 per function (one reward: nothing to normalize); sums -a, a, 0 -> mean 0, std a -> -1, 1, 0
    per_func[2] = math.nan
    got = estimator("normalize_then_sum").fn(per_func, weights, 2, exact)
    assert got.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0], rel=1e-6)
    # one rollout per group (evaluation with num_generations_eval=1): nothing to normalize, all 0
    assert estimator("normalize_then_sum").fn(per_func[:1], weights, 1, exact).tolist() == [0.0]
