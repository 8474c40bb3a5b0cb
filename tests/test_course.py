"""trl_ext.objective.course (the course-only helpers that trl_ext.cs336 re-exports) against values worked out by hand or
by an independent formula. Moved here from test_functional.py and test_functional_preference.py with their
assertions."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_model_for_tests

from trl_ext.objective import course as C


class TableLM(torch.nn.Module):
    """A 'language model' whose logits depend only on the current token: logits = table[token]."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


def make_reward_fn(table):
    """reward_fn that looks each response up in a dict of reward values."""

    def reward_fn(response, ground_truth):
        return {"reward": table[response], "format_reward": 1.0, "answer_reward": table[response]}

    return reward_fn


def softplus(x: float) -> float:
    """-log sigmoid(-x), by hand."""
    return math.log1p(math.exp(x))


class CharTokenizer:
    """One token per character (id = ord), pad id 0: makes tokenization checkable by eye."""

    pad_token_id = 0

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


def test_tokenize_prompt_and_output_shifts_pads_and_masks_by_hand():
    out = C.tokenize_prompt_and_output(["ab", "a"], ["cde", "b"], CharTokenizer())
    a, b, c, d, e = (ord(x) for x in "abcde")
    # row 0: full = a b c d e ; row 1: full = a b pad pad pad
    assert out["input_ids"].tolist() == [[a, b, c, d], [a, b, 0, 0]]
    assert out["labels"].tolist() == [[b, c, d, e], [b, 0, 0, 0]]
    assert out["response_mask"].tolist() == [[False, True, True, True], [True, False, False, False]]


def test_tokenize_prompt_and_output_with_real_tokenizer(tokenizer):
    prompts, outputs = ["What is 2 + 3?", "Hi"], [" 5", " Hello there, friend."]
    out = C.tokenize_prompt_and_output(prompts, outputs, tokenizer)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        o_ids = tokenizer(o, add_special_tokens=False)["input_ids"]
        assert out["labels"][i][out["response_mask"][i]].tolist() == o_ids
        assert out["input_ids"][i, : len(p_ids)].tolist() == p_ids
    assert out["input_ids"].shape == out["labels"].shape == out["response_mask"].shape


def test_tokenize_prompt_and_output_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="output_strs has 1"):
        C.tokenize_prompt_and_output(["a", "b"], ["c"], CharTokenizer())


def test_get_response_log_probs_by_hand():
    # token 0 -> probs (0.5, 0.25, 0.25); token 1 -> (0.1, 0.6, 0.3)
    table = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3], [1 / 3, 1 / 3, 1 / 3]]).log()
    model = TableLM(table)
    out = C.get_response_log_probs(model, torch.tensor([[0, 1]]), torch.tensor([[1, 2]]), return_token_entropy=True)
    torch.testing.assert_close(out["log_probs"], torch.tensor([[math.log(0.25), math.log(0.3)]]))
    h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    h1 = -(0.1 * math.log(0.1) + 0.6 * math.log(0.6) + 0.3 * math.log(0.3))
    torch.testing.assert_close(out["token_entropy"], torch.tensor([[h0, h1]]))


def test_mean_response_entropy_by_hand():
    # token 0 -> h0, token 1 -> h1, token 2 -> uniform (ln 3); only positions whose label is a completion token count
    table = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3], [1 / 3, 1 / 3, 1 / 3]]).log()
    modes = []

    class ModeRecordingLM(TableLM):
        def forward(self, input_ids, attention_mask=None):
            modes.append(self.training)
            return super().forward(input_ids, attention_mask)

    model = ModeRecordingLM(table).train()
    h1 = -(0.1 * math.log(0.1) + 0.6 * math.log(0.6) + 0.3 * math.log(0.3))
    # [0, 1 | 2, 0]: the completion's tokens are predicted after 1 and after 2; [2 | 1]: after 2; [1, 0 | ]: none
    prompt_ids, completion_ids = [[0, 1], [2], [1, 0]], [[2, 0], [1], []]
    expected = (h1 + 2 * math.log(3)) / 3  # a mean over the 3 response tokens, not over the sequences
    for batch_size in (1, 2, 3):  # padding (with token 1, a real token: masked, never read) does not change it
        got = C.mean_response_entropy(model, prompt_ids, completion_ids, pad_token_id=1, batch_size=batch_size)
        assert got == pytest.approx(expected, rel=1e-6)
    assert modes and not any(modes) and model.training  # eval mode for the forwards, the caller's mode restored
    assert C.mean_response_entropy(model, [[0, 1]], [[]], pad_token_id=0) == 0.0  # no response token
    with pytest.raises(ValueError, match="prompt_ids has 2 sequences but completion_ids has 1"):
        C.mean_response_entropy(model, [[0], [1]], [[2]], pad_token_id=0)


def test_group_normalized_rewards_by_hand():
    # group 1 rewards [1, 2, 3, 6]: mean 3, centred [-2, -1, 0, 3], unbiased var 14/3
    # group 2 rewards [0, 0, 0, 1]: mean 1/4, centred [-1/4]*3 + [3/4], var (3/16 + 9/16) / 3 = 1/4 -> std 1/2
    rewards = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 6.0, "z": 0.0, "o": 1.0}
    responses = list("abcd") + list("zzzo")
    adv, raw, meta = C.compute_group_normalized_rewards(
        make_reward_fn(rewards), responses, ["gt"] * 8, group_size=4, advantage_eps=1e-6, normalize_by_std=True
    )
    std1 = math.sqrt(14 / 3)
    expected = (
        [-2 / (std1 + 1e-6), -1 / (std1 + 1e-6), 0.0, 3 / (std1 + 1e-6)] + [-0.25 / 0.500001] * 3 + [0.75 / 0.500001]
    )
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert raw.tolist() == [1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 0.0, 1.0]
    assert meta["reward_mean"] == pytest.approx(13 / 8)
    assert meta["reward_max"] == 6.0 and meta["reward_min"] == 0.0
    assert meta["reward_std"] == pytest.approx(torch.tensor([1.0, 2, 3, 6, 0, 0, 0, 1]).std().item())
    assert meta["format_reward_mean"] == 1.0 and meta["answer_reward_mean"] == pytest.approx(13 / 8)

    adv_raw, _, _ = C.compute_group_normalized_rewards(
        make_reward_fn(rewards), responses, ["gt"] * 8, group_size=4, advantage_eps=1e-6, normalize_by_std=False
    )
    assert adv_raw.tolist() == pytest.approx([-2, -1, 0, 3, -0.25, -0.25, -0.25, 0.75])


def test_none_and_nan_rewards_are_excluded_and_counted():
    # valid rewards [1, 0, 1]: mean 2/3, centred [1/3, -2/3, 1/3], unbiased var (1/9 + 4/9 + 1/9) / 2 = 1/3
    table = {"good": 1.0, "bad": 0.0, "none": None, "nan": math.nan}
    fn = make_reward_fn(table)
    with pytest.warns(UserWarning, match="2 of 8 rewards were None or NaN"):
        adv, raw, meta = C.compute_group_normalized_rewards(
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
        C.compute_group_normalized_rewards(fn, ["a"] * 3, ["x"] * 3, 2, 1e-6, True)
    with pytest.raises(ValueError, match="group_size=1 with normalize_by_std=True"):
        C.compute_group_normalized_rewards(fn, ["a"] * 3, ["x"] * 3, 1, 1e-6, True)
    with pytest.raises(ValueError, match="repeated_ground_truths has 2"):
        C.compute_group_normalized_rewards(fn, ["a"] * 4, ["x"] * 2, 2, 1e-6, True)
    with pytest.raises(ValueError, match="reward_fn returned 1.0 for rollout 0"):
        C.compute_group_normalized_rewards(lambda r, g: 1.0, ["a"] * 2, ["x"] * 2, 2, 1e-6, True)
    with pytest.raises(ValueError, match="'reward' key"):
        C.compute_group_normalized_rewards(lambda r, g: {"score": 1.0}, ["a"] * 2, ["x"] * 2, 2, 1e-6, True)
    # group_size 1 is fine without std normalization: advantages are all 0
    adv, _, _ = C.compute_group_normalized_rewards(fn, ["a"] * 3, ["x"] * 3, 1, 1e-6, False)
    assert adv.tolist() == [0.0] * 3


def test_grpo_microbatch_train_step_value_gradient_and_accumulation():
    # no_baseline with reward -1 makes the per-token loss equal to the log-probs: [[2,2,0,0],[1,1,1,1]]
    logp = torch.tensor([[2.0, 2.0, math.nan, math.nan], [1.0, 1.0, 1.0, 1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    rewards = torch.tensor([[-1.0], [-1.0]])
    loss, _ = C.grpo_microbatch_train_step(logp, mask, 2, "no_baseline", raw_rewards=rewards)
    assert loss.item() == pytest.approx(0.75)  # 1.5 / 2 accumulation steps
    # d loss / d logp: row 0 -> 1/2 (per-example mean) * 1/2 (batch) * 1/2 (accum); row 1 -> 1/4 * 1/2 * 1/2
    expected = torch.tensor([[0.125, 0.125, 0.0, 0.0], [0.0625] * 4])
    torch.testing.assert_close(logp.grad, expected)
    C.grpo_microbatch_train_step(logp, mask, 2, "no_baseline", raw_rewards=rewards)
    torch.testing.assert_close(logp.grad, 2 * expected)

    logp.grad = None
    loss, _ = C.grpo_microbatch_train_step(
        logp, mask, 1, "no_baseline", raw_rewards=rewards, length_normalization="masked_normalize", normalize_constant=4
    )
    assert loss.item() == pytest.approx(1.0)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.125, 0.125, 0.0, 0.0], [0.125] * 4]))


def test_grpo_microbatch_train_step_errors():
    logp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"response_mask rows \[1\] have no response token"):
        C.grpo_microbatch_train_step(
            logp, torch.tensor([[1, 0, 0], [0, 0, 0]]), 1, "reinforce_with_baseline", advantages=torch.ones(2, 1)
        )
    with pytest.raises(ValueError, match="response_mask has shape"):
        C.grpo_microbatch_train_step(logp, torch.ones(2, 4), 1, "reinforce_with_baseline", advantages=torch.ones(2, 1))
    with pytest.raises(ValueError, match="needs normalize_constant"):
        C.grpo_microbatch_train_step(
            logp,
            torch.ones(2, 3),
            1,
            "reinforce_with_baseline",
            advantages=torch.ones(2, 1),
            length_normalization="masked_normalize",
        )
    with pytest.raises(ValueError, match="length_normalization='seq_mean_token_sum'"):
        C.grpo_microbatch_train_step(
            logp,
            torch.ones(2, 3),
            1,
            "reinforce_with_baseline",
            advantages=torch.ones(2, 1),
            length_normalization="seq_mean_token_sum",
        )


def test_sft_microbatch_train_step_by_hand():
    # row 0: -(-2 - 3) = 5 over response tokens; row 1: 1 ; / normalize_constant 2 -> [2.5, 0.5]; mean 1.5; / 3 accum
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-9.0, -1.0, math.nan]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    loss, meta = C.sft_microbatch_train_step(logp, mask, gradient_accumulation_steps=3, normalize_constant=2.0)
    assert loss.item() == pytest.approx(0.5)
    assert meta["nll_per_example"].tolist() == pytest.approx([2.5, 0.5])
    g = -1 / 2 / 2 / 3  # d/dlogp: -1 (NLL) / constant / batch / accum
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, g, g], [0.0, g, 0.0]]))


def test_gae_by_hand():
    # delta = 1 + 0.99 * 0.5 - 0.5 = 0.995 ; A2 = 0.995 ; A1 = 0.995 + 0.9405 * 0.995 = 1.9307975
    # A0 = 0.995 + 0.9405 * 1.9307975 = 0.995 + 1.81591504875 = 2.81091504875
    adv = C.compute_gae(
        torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64), torch.tensor([0.5] * 4, dtype=torch.float64)
    )
    assert adv.tolist() == pytest.approx([2.81091504875, 1.9307975, 0.995])
    # gamma = lam = 1: return-to-go + V_T - V_t = [3, 2, 1]
    assert C.compute_gae(torch.ones(3), torch.full((4,), 0.5), gamma=1.0, lam=1.0).tolist() == pytest.approx(
        [3.0, 2.0, 1.0]
    )
    # batched rows agree with the 1-D call
    batch = C.compute_gae(torch.ones(2, 3), torch.full((2, 4), 0.5))
    assert batch[1].tolist() == pytest.approx([2.81091504875, 1.9307975, 0.995], abs=1e-6)
    with pytest.raises(ValueError, match="expected values to be"):
        C.compute_gae(torch.ones(3), torch.ones(3))


def summed_response_logp(model, tokenizer, prompt: str, response: str) -> float:
    """Independent reference: full forward, log-softmax, sum over the response tokens and the appended EOS."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return sum(log_probs[len(prompt_ids) - 1 + j, t].item() for j, t in enumerate(response_ids))


def test_per_instance_dpo_loss_matches_an_independent_computation(tokenizer):
    policy, ref = tiny_model_for_tests(tokenizer, seed=1), tiny_model_for_tests(tokenizer, seed=2)
    prompt, chosen, rejected = "Question: what is 2 + 2?\nAnswer:", " 4", " five, I think"
    h = (
        summed_response_logp(policy, tokenizer, prompt, chosen) - summed_response_logp(ref, tokenizer, prompt, chosen)
    ) - (
        summed_response_logp(policy, tokenizer, prompt, rejected)
        - summed_response_logp(ref, tokenizer, prompt, rejected)
    )
    for eps in (0.0, 0.1):
        loss = C.per_instance_dpo_loss(policy, ref, tokenizer, 0.1, prompt, chosen, rejected, label_smoothing=eps)
        expected = (1 - eps) * softplus(-0.1 * h) + eps * softplus(0.1 * h)
        assert loss.item() == pytest.approx(expected, abs=1e-5)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    assert all(p.grad is None for p in ref.parameters())


def test_per_instance_dpo_loss_is_log2_when_policy_is_the_reference(tokenizer):
    model = tiny_model_for_tests(tokenizer)
    loss = C.per_instance_dpo_loss(model, model, tokenizer, 0.1, "Hi.\n", "Hello!", "Go away.")
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.parametrize(
    "chosen, rejected, match",
    [
        ("", "No.", "response_chosen is empty"),
        ("Yes.", "", "response_rejected is empty"),
        ("Same.", "Same.", "identical"),
    ],
)
def test_per_instance_dpo_loss_rejects_bad_pairs(tokenizer, chosen, rejected, match):
    model = tiny_model_for_tests(tokenizer)
    with pytest.raises(ValueError, match=match):
        C.per_instance_dpo_loss(model, model, tokenizer, 0.1, "Prompt:", chosen, rejected)
