"""trl_ext.functional against values worked out by hand (shown in comments) or by an independent formula."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_ext import functional as F


class CharTokenizer:
    """One token per character (id = ord), pad id 0: makes tokenization checkable by eye."""

    pad_token_id = 0

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


# ---------------------------------------------------------------- tokenize_prompt_and_output


def test_tokenize_prompt_and_output_shifts_pads_and_masks_by_hand():
    out = F.tokenize_prompt_and_output(["ab", "a"], ["cde", "b"], CharTokenizer())
    a, b, c, d, e = (ord(x) for x in "abcde")
    # row 0: full = a b c d e ; row 1: full = a b pad pad pad
    assert out["input_ids"].tolist() == [[a, b, c, d], [a, b, 0, 0]]
    assert out["labels"].tolist() == [[b, c, d, e], [b, 0, 0, 0]]
    assert out["response_mask"].tolist() == [[False, True, True, True], [True, False, False, False]]


def test_tokenize_prompt_and_output_with_real_tokenizer(tokenizer):
    prompts, outputs = ["What is 2 + 3?", "Hi"], [" 5", " Hello there, friend."]
    out = F.tokenize_prompt_and_output(prompts, outputs, tokenizer)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        o_ids = tokenizer(o, add_special_tokens=False)["input_ids"]
        assert out["labels"][i][out["response_mask"][i]].tolist() == o_ids
        assert out["input_ids"][i, : len(p_ids)].tolist() == p_ids
    assert out["input_ids"].shape == out["labels"].shape == out["response_mask"].shape


def test_tokenize_prompt_and_output_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="output_strs has 1"):
        F.tokenize_prompt_and_output(["a", "b"], ["c"], CharTokenizer())


# ---------------------------------------------------------------- entropy and log-probs


def test_entropy_with_minus_inf_logits_by_hand():
    logits = torch.tensor([[0.0, -math.inf, -math.inf], [0.0, 0.0, -math.inf]])
    h = F.compute_entropy(logits)
    assert h[0].item() == 0.0
    assert h[1].item() == pytest.approx(math.log(2), abs=1e-6)
    assert not torch.isnan(h).any()


def test_entropy_matches_categorical_and_uniform():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(F.compute_entropy(logits), expected, atol=1e-5, rtol=1e-5)
    assert F.compute_entropy(torch.zeros(7)).item() == pytest.approx(math.log(7), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_entropy_finite_in_low_precision(dtype):
    logits = torch.tensor([[60000.0, 0.0, -60000.0, -math.inf], [0.0, 0.0, 0.0, 0.0]]).to(dtype)
    h = F.compute_entropy(logits)
    assert h.dtype == dtype and torch.isfinite(h).all()
    assert h[0].item() == pytest.approx(0.0, abs=1e-3)
    assert h[1].float().item() == pytest.approx(math.log(4), abs=2e-2)


class TableLM(torch.nn.Module):
    """A 'language model' whose logits depend only on the current token: logits = table[token]."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_get_response_log_probs_by_hand():
    # token 0 -> probs (0.5, 0.25, 0.25); token 1 -> (0.1, 0.6, 0.3)
    table = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3], [1 / 3, 1 / 3, 1 / 3]]).log()
    model = TableLM(table)
    out = F.get_response_log_probs(model, torch.tensor([[0, 1]]), torch.tensor([[1, 2]]), return_token_entropy=True)
    torch.testing.assert_close(out["log_probs"], torch.tensor([[math.log(0.25), math.log(0.3)]]))
    h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    h1 = -(0.1 * math.log(0.1) + 0.6 * math.log(0.6) + 0.3 * math.log(0.3))
    torch.testing.assert_close(out["token_entropy"], torch.tensor([[h0, h1]]))


# ---------------------------------------------------------------- masked reductions


def test_length_normalization_example_by_hand():
    loss = torch.tensor([[2.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    # masked_mean per example: [2, 1] -> batch mean 1.5 ; masked_normalize by 4: [4/4, 4/4] -> 1.0
    assert F.compute_grpo_loss(loss, mask, "masked_mean").item() == pytest.approx(1.5)
    assert F.compute_grpo_loss(loss, mask, "masked_normalize", normalize_constant=4).item() == pytest.approx(1.0)
    # padding holding garbage never enters numerator or denominator
    garbage = loss.clone()
    garbage[0, 2:] = torch.tensor([math.nan, math.inf])
    assert F.compute_grpo_loss(garbage, mask, "masked_mean").item() == pytest.approx(1.5)
    assert F.compute_grpo_loss(garbage, mask, "masked_normalize", normalize_constant=4).item() == pytest.approx(1.0)


def test_masked_mean_and_normalize_dims_and_empty_slices():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 0, 1], [0, 0, 0]])
    assert F.masked_mean(x, m).item() == pytest.approx(2.0)  # (1 + 3) / 2
    per_row = F.masked_mean(x, m, dim=1)
    assert per_row[0].item() == pytest.approx(2.0) and math.isnan(per_row[1].item())  # 0/0 for the empty row
    assert F.masked_mean(x, m, dim=0).tolist()[0] == pytest.approx(1.0)
    assert F.masked_normalize(x, m, dim=1, normalize_constant=2.0).tolist() == [2.0, 0.0]
    assert F.masked_normalize(x, m).item() == pytest.approx(4.0)


def test_masked_functions_reject_shape_mismatch():
    with pytest.raises(ValueError, match="mask has shape"):
        F.masked_mean(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask has shape"):
        F.masked_normalize(torch.zeros(2, 3), torch.ones(3))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e3, 1e3), st.booleans(), st.floats(-1e3, 1e3)), min_size=1, max_size=20))
def test_masked_mean_ignores_masked_values(rows):
    values = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    mask = torch.tensor([r[1] for r in rows])
    other = torch.where(mask, values, torch.tensor([r[2] for r in rows], dtype=torch.float64))
    a, b = F.masked_mean(values, mask), F.masked_mean(other, mask)
    if mask.any():
        assert a.item() == pytest.approx(b.item())
        assert a.item() == pytest.approx(values[mask].mean().item())
    else:
        assert math.isnan(a.item()) and math.isnan(b.item())
    assert F.masked_normalize(values, mask, normalize_constant=3.0).item() == pytest.approx(
        F.masked_normalize(other, mask, normalize_constant=3.0).item()
    )


# ---------------------------------------------------------------- group-normalized rewards


def make_reward_fn(table):
    """reward_fn that looks each response up in a dict of reward values."""

    def reward_fn(response, ground_truth):
        return {"reward": table[response], "format_reward": 1.0, "answer_reward": table[response]}

    return reward_fn


def test_group_normalized_rewards_by_hand():
    # group 1 rewards [1, 2, 3, 6]: mean 3, centred [-2, -1, 0, 3], unbiased var 14/3
    # group 2 rewards [0, 0, 0, 1]: mean 1/4, centred [-1/4]*3 + [3/4], var (3/16 + 9/16) / 3 = 1/4 -> std 1/2
    rewards = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 6.0, "z": 0.0, "o": 1.0}
    responses = list("abcd") + list("zzzo")
    adv, raw, meta = F.compute_group_normalized_rewards(
        make_reward_fn(rewards), responses, ["gt"] * 8, group_size=4, advantage_eps=1e-6, normalize_by_std=True
    )
    std1 = math.sqrt(14 / 3)
    expected = [-2 / (std1 + 1e-6), -1 / (std1 + 1e-6), 0.0, 3 / (std1 + 1e-6)] + [-0.25 / 0.500001] * 3 + [0.75 / 0.500001]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert raw.tolist() == [1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 0.0, 1.0]
    assert meta["reward_mean"] == pytest.approx(13 / 8)
    assert meta["reward_max"] == 6.0 and meta["reward_min"] == 0.0
    assert meta["reward_std"] == pytest.approx(torch.tensor([1.0, 2, 3, 6, 0, 0, 0, 1]).std().item())
    assert meta["format_reward_mean"] == 1.0 and meta["answer_reward_mean"] == pytest.approx(13 / 8)

    adv_raw, _, _ = F.compute_group_normalized_rewards(
        make_reward_fn(rewards), responses, ["gt"] * 8, group_size=4, advantage_eps=1e-6, normalize_by_std=False
    )
    assert adv_raw.tolist() == pytest.approx([-2, -1, 0, 3, -0.25, -0.25, -0.25, 0.75])


def test_group_advantages_agree_with_torch_std():
    torch.manual_seed(1)
    r = torch.rand(12)
    grouped = r.view(3, 4).double()
    expected = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    torch.testing.assert_close(F.compute_group_advantages(r, 4), expected.flatten().float())


def test_equal_rewards_give_exactly_zero_advantage():
    for value in (0.1, 1 / 3, 7.0, 0.0):
        adv = F.compute_group_advantages(torch.full((6,), value), group_size=3)
        assert adv.tolist() == [0.0] * 6


def test_nearly_equal_rewards_give_finite_advantages():
    # centred values +-5e-6, unbiased std sqrt(2 * 25e-12) = 7.07e-6 -> 5e-6 / (7.07e-6 + 1e-6) = 0.62
    adv = F.compute_group_advantages(torch.tensor([1.0, 1.00001]), group_size=2, advantage_eps=1e-6)
    assert torch.isfinite(adv).all()
    assert adv.tolist() == pytest.approx([-0.62, 0.62], abs=0.005)


def test_none_and_nan_rewards_are_excluded_and_counted():
    # valid rewards [1, 0, 1]: mean 2/3, centred [1/3, -2/3, 1/3], unbiased var (1/9 + 4/9 + 1/9) / 2 = 1/3
    table = {"good": 1.0, "bad": 0.0, "none": None, "nan": math.nan}
    fn = make_reward_fn(table)
    with pytest.warns(UserWarning, match="2 of 8 rewards were None or NaN"):
        adv, raw, meta = F.compute_group_normalized_rewards(
            fn, ["good", "none", "bad", "good", "nan", "bad", "bad", "bad"], ["x"] * 8, 4, 1e-6, True
        )
    s = math.sqrt(1 / 3) + 1e-6
    assert adv[:4].tolist() == pytest.approx([(1 / 3) / s, 0.0, (-2 / 3) / s, (1 / 3) / s], abs=1e-6)
    assert adv[4:].tolist() == [0.0] * 4  # NaN row gets 0; the rest are equal bads
    assert math.isnan(raw[1].item()) and math.isnan(raw[4].item())
    assert meta["num_excluded"] == 2 and meta["reward_mean"] == pytest.approx(2 / 6)


def test_group_normalized_rewards_errors_name_the_argument():
    fn = make_reward_fn({"a": 1.0})
    with pytest.raises(ValueError, match="not divisible by group_size=2"):
        F.compute_group_normalized_rewards(fn, ["a"] * 3, ["x"] * 3, 2, 1e-6, True)
    with pytest.raises(ValueError, match="group_size=1 with normalize_by_std=True"):
        F.compute_group_normalized_rewards(fn, ["a"] * 3, ["x"] * 3, 1, 1e-6, True)
    with pytest.raises(ValueError, match="repeated_ground_truths has 2"):
        F.compute_group_normalized_rewards(fn, ["a"] * 4, ["x"] * 2, 2, 1e-6, True)
    with pytest.raises(ValueError, match="reward_fn returned 1.0 for rollout 0"):
        F.compute_group_normalized_rewards(lambda r, g: 1.0, ["a"] * 2, ["x"] * 2, 2, 1e-6, True)
    with pytest.raises(ValueError, match="'reward' key"):
        F.compute_group_normalized_rewards(lambda r, g: {"score": 1.0}, ["a"] * 2, ["x"] * 2, 2, 1e-6, True)
    # group_size 1 is fine without std normalization: advantages are all 0
    adv, _, _ = F.compute_group_normalized_rewards(fn, ["a"] * 3, ["x"] * 3, 1, 1e-6, False)
    assert adv.tolist() == [0.0] * 3


@settings(max_examples=50, deadline=None)
@given(
    st.integers(2, 6).flatmap(
        lambda g: st.tuples(st.just(g), st.lists(st.floats(-100, 100), min_size=g, max_size=4 * g).map(lambda v: v[: len(v) // g * g]))
    ),
    st.booleans(),
)
def test_advantages_sum_to_zero_per_group(group_and_rewards, normalize_by_std):
    group_size, rewards = group_and_rewards
    adv = F.compute_group_advantages(torch.tensor(rewards, dtype=torch.float64), group_size, 1e-6, normalize_by_std)
    sums = adv.double().view(-1, group_size).sum(dim=1)
    assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-3)
    assert torch.isfinite(adv).all()


# ---------------------------------------------------------------- policy-gradient losses


def test_naive_policy_gradient_loss_by_hand():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.25]])
    loss = F.compute_naive_policy_gradient_loss(torch.tensor([[2.0], [-1.0]]), logp)
    assert loss.tolist() == [[2.0, 4.0], [-0.5, -0.25]]


def test_grpo_clip_loss_by_hand():
    # cliprange 0.2; (A, ratio): (1, 1.5) -> -min(1.5, 1.2) = -1.2 clipped; (-1, 1.5) -> -min(-1.5, -1.2) = 1.5
    # (1, 0.5) -> -min(0.5, 0.8) = -0.5 ; (-1, 0.5) -> -min(-0.5, -0.8) = 0.8 clipped
    old = torch.zeros(4, 1)
    logp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]]))
    adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]])
    loss, meta = F.compute_grpo_clip_loss(adv, logp, old, cliprange=0.2)
    assert loss.flatten().tolist() == pytest.approx([-1.2, 1.5, -0.5, 0.8])
    assert meta["clipped"].flatten().tolist() == [True, False, False, True]


@pytest.mark.parametrize("same_object", [True, False])
def test_grpo_clip_never_differentiates_through_old_log_probs(same_object):
    logp = torch.tensor([[-1.0, -0.3, -2.0]], requires_grad=True)
    old = logp if same_object else logp.detach().clone().requires_grad_(True)
    loss, _ = F.compute_grpo_clip_loss(torch.tensor([[2.0]]), logp, old, cliprange=0.2)
    loss.sum().backward()
    assert logp.grad.tolist() == [[-2.0, -2.0, -2.0]]  # ratio = 1, d(-ratio * A)/d logp = -A
    if not same_object:
        assert old.grad is None


@settings(max_examples=100, deadline=None)
@given(st.floats(-3, 3), st.floats(-5, 5).filter(lambda a: abs(a) > 1e-3), st.floats(0.0, 0.5))
def test_grpo_clip_loss_bounds(log_ratio, advantage, eps):
    loss, _ = F.compute_grpo_clip_loss(
        torch.tensor([[advantage]], dtype=torch.float64), torch.tensor([[log_ratio]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64), eps
    )
    ratio = math.exp(log_ratio)
    # the objective min(ratio A, clip(ratio) A) never exceeds the clipped ceiling (1 + eps) A for A > 0,
    # and for A < 0 the loss is at least (1 - eps) |A|
    if advantage > 0:
        assert loss.item() >= -(1 + eps) * advantage - 1e-9
    else:
        assert loss.item() >= (1 - eps) * abs(advantage) - 1e-9
    assert loss.item() <= -min(ratio * advantage, min(max(ratio, 1 - eps), 1 + eps) * advantage) + 1e-9


def test_policy_gradient_loss_dispatch_and_errors():
    logp = torch.tensor([[-1.0, -2.0]])
    a = torch.tensor([[3.0]])
    assert F.compute_policy_gradient_loss(logp, "no_baseline", raw_rewards=a)[0].tolist() == [[3.0, 6.0]]
    assert F.compute_policy_gradient_loss(logp, "reinforce_with_baseline", advantages=a)[0].tolist() == [[3.0, 6.0]]
    with pytest.raises(ValueError, match="loss_type='ppo' is not supported"):
        F.compute_policy_gradient_loss(logp, "ppo", advantages=a)
    with pytest.raises(ValueError, match="needs raw_rewards"):
        F.compute_policy_gradient_loss(logp, "no_baseline", advantages=a)
    with pytest.raises(ValueError, match="needs old_log_probs, cliprange"):
        F.compute_policy_gradient_loss(logp, "grpo_clip", advantages=a)
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 1\)"):
        F.compute_policy_gradient_loss(logp, "reinforce_with_baseline", advantages=torch.ones(2, 1))
    with pytest.raises(ValueError, match="old_log_probs has shape"):
        F.compute_grpo_clip_loss(a, logp, torch.zeros(1, 3), 0.2)


# ---------------------------------------------------------------- train steps


def test_grpo_microbatch_train_step_value_gradient_and_accumulation():
    # no_baseline with reward -1 makes the per-token loss equal to the log-probs: [[2,2,0,0],[1,1,1,1]]
    logp = torch.tensor([[2.0, 2.0, math.nan, math.nan], [1.0, 1.0, 1.0, 1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    rewards = torch.tensor([[-1.0], [-1.0]])
    loss, _ = F.grpo_microbatch_train_step(logp, mask, 2, "no_baseline", raw_rewards=rewards)
    assert loss.item() == pytest.approx(0.75)  # 1.5 / 2 accumulation steps
    # d loss / d logp: row 0 -> 1/2 (per-example mean) * 1/2 (batch) * 1/2 (accum); row 1 -> 1/4 * 1/2 * 1/2
    expected = torch.tensor([[0.125, 0.125, 0.0, 0.0], [0.0625] * 4])
    torch.testing.assert_close(logp.grad, expected)
    F.grpo_microbatch_train_step(logp, mask, 2, "no_baseline", raw_rewards=rewards)
    torch.testing.assert_close(logp.grad, 2 * expected)

    logp.grad = None
    loss, _ = F.grpo_microbatch_train_step(
        logp, mask, 1, "no_baseline", raw_rewards=rewards, length_normalization="masked_normalize", normalize_constant=4
    )
    assert loss.item() == pytest.approx(1.0)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.125, 0.125, 0.0, 0.0], [0.125] * 4]))


def test_grpo_microbatch_train_step_errors():
    logp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"response_mask rows \[1\] have no response token"):
        F.grpo_microbatch_train_step(logp, torch.tensor([[1, 0, 0], [0, 0, 0]]), 1, "reinforce_with_baseline", advantages=torch.ones(2, 1))
    with pytest.raises(ValueError, match="response_mask has shape"):
        F.grpo_microbatch_train_step(logp, torch.ones(2, 4), 1, "reinforce_with_baseline", advantages=torch.ones(2, 1))
    with pytest.raises(ValueError, match="needs normalize_constant"):
        F.grpo_microbatch_train_step(
            logp, torch.ones(2, 3), 1, "reinforce_with_baseline", advantages=torch.ones(2, 1), length_normalization="masked_normalize"
        )
    with pytest.raises(ValueError, match="length_normalization='token_mean'"):
        F.grpo_microbatch_train_step(logp, torch.ones(2, 3), 1, "reinforce_with_baseline", advantages=torch.ones(2, 1), length_normalization="token_mean")


def test_sft_microbatch_train_step_by_hand():
    # row 0: -(-2 - 3) = 5 over response tokens; row 1: 1 ; / normalize_constant 2 -> [2.5, 0.5]; mean 1.5; / 3 accum
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-9.0, -1.0, math.nan]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    loss, meta = F.sft_microbatch_train_step(logp, mask, gradient_accumulation_steps=3, normalize_constant=2.0)
    assert loss.item() == pytest.approx(0.5)
    assert meta["nll_per_example"].tolist() == pytest.approx([2.5, 0.5])
    g = -1 / 2 / 2 / 3  # d/dlogp: -1 (NLL) / constant / batch / accum
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, g, g], [0.0, g, 0.0]]))


# ---------------------------------------------------------------- KL and GAE


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    # d = ref - logp = -0.5: k1 = 0.5, k2 = 0.125, k3 = e^-0.5 + 0.5 - 1 = 0.10653
    assert F.compute_kl(logp, ref, "k1").item() == pytest.approx(0.5)
    assert F.compute_kl(logp, ref, "k2").item() == pytest.approx(0.125)
    assert F.compute_kl(logp, ref).item() == pytest.approx(0.1065, abs=1e-4)
    with pytest.raises(ValueError, match="estimator='k4' is not supported"):
        F.compute_kl(logp, ref, "k4")
    with pytest.raises(ValueError, match="ref_log_probs has shape"):
        F.compute_kl(logp, torch.zeros(2))


def test_k3_is_an_unbiased_kl_estimate():
    # sample tokens from p, average k3 -> close to the exact KL(p || q)
    torch.manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    exact = (p * (p / q).log()).sum().item()
    tokens = torch.multinomial(p, 200_000, replacement=True)
    k3 = F.compute_kl(p.log()[tokens], q.log()[tokens], "k3").mean().item()
    assert k3 == pytest.approx(exact, abs=0.01)


@settings(max_examples=200, deadline=None)
@given(st.floats(-30, 0), st.floats(-30, 0))
def test_k3_and_k2_never_negative(logp, ref):
    for estimator in ("k2", "k3"):
        assert F.compute_kl(torch.tensor([logp]), torch.tensor([ref]), estimator).item() >= 0.0


def test_gae_by_hand():
    # delta = 1 + 0.99 * 0.5 - 0.5 = 0.995 ; A2 = 0.995 ; A1 = 0.995 + 0.9405 * 0.995 = 1.9307975
    # A0 = 0.995 + 0.9405 * 1.9307975 = 0.995 + 1.81591504875 = 2.81091504875
    adv = F.compute_gae(torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64), torch.tensor([0.5] * 4, dtype=torch.float64))
    assert adv.tolist() == pytest.approx([2.81091504875, 1.9307975, 0.995])
    # gamma = lam = 1: return-to-go + V_T - V_t = [3, 2, 1]
    assert F.compute_gae(torch.ones(3), torch.full((4,), 0.5), gamma=1.0, lam=1.0).tolist() == pytest.approx([3.0, 2.0, 1.0])
    # batched rows agree with the 1-D call
    batch = F.compute_gae(torch.ones(2, 3), torch.full((2, 4), 0.5))
    assert batch[1].tolist() == pytest.approx([2.81091504875, 1.9307975, 0.995], abs=1e-6)
    with pytest.raises(ValueError, match="expected values to be"):
        F.compute_gae(torch.ones(3), torch.ones(3))


def test_compute_grpo_loss_empty_rows_count_as_zero_when_allowed():
    # TRL's convention for rows masked out entirely (mask_truncated_completions): they add 0 but count in the mean
    loss = torch.tensor([[3.0, 1.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert F.compute_grpo_loss(loss, mask, allow_empty_rows=True).item() == pytest.approx(1.0)  # (2 + 0) / 2


def test_adaptive_kl_coefficient_by_hand():
    # measured 0.12 vs target 0.1: error 0.2 (at the clip) -> beta * (1 + 0.2 * 100 / 1000) = 0.05 * 1.02
    assert F.adaptive_kl_coefficient(0.05, 0.12, 0.1, 1000, n_steps=100) == pytest.approx(0.051)
    # measured 0.09: error -0.1 -> 0.05 * (1 - 0.1 * 10 / 1000) = 0.04995
    assert F.adaptive_kl_coefficient(0.05, 0.09, 0.1, 1000, n_steps=10) == pytest.approx(0.04995)
    # far above target: the error is clipped at +0.2
    assert F.adaptive_kl_coefficient(1.0, 100.0, 0.1, 10, n_steps=1) == pytest.approx(1.02)
    with pytest.raises(ValueError, match="kl_target=0"):
        F.adaptive_kl_coefficient(0.05, 0.1, 0, 1000)
