"""trl_ext.cs336: every adapter of the course's tests/adapters.py, against values worked out by hand."""

import inspect
import json
import math

import pytest
import torch

import trl_ext.cs336 as cs336

# The course's tests/adapters.py: name -> parameter names, in order (CS336 spring 2025 assignment 5 + supplement).
COURSE_ADAPTERS = {
    "run_tokenize_prompt_and_output": ["prompt_strs", "output_strs", "tokenizer"],
    "run_compute_group_normalized_rewards": [
        "reward_fn",
        "rollout_responses",
        "repeated_ground_truths",
        "group_size",
        "advantage_eps",
        "normalize_by_std",
    ],
    "run_compute_entropy": ["logits"],
    "run_get_response_log_probs": ["model", "input_ids", "labels", "return_token_entropy"],
    "run_compute_naive_policy_gradient_loss": ["raw_rewards_or_advantages", "policy_log_probs"],
    "run_compute_grpo_clip_loss": ["advantages", "policy_log_probs", "old_log_probs", "cliprange"],
    "run_compute_policy_gradient_loss": [
        "policy_log_probs",
        "loss_type",
        "raw_rewards",
        "advantages",
        "old_log_probs",
        "cliprange",
    ],
    "run_masked_mean": ["tensor", "mask", "dim"],
    "run_sft_microbatch_train_step": [
        "policy_log_probs",
        "response_mask",
        "gradient_accumulation_steps",
        "normalize_constant",
    ],
    "run_grpo_microbatch_train_step": [
        "policy_log_probs",
        "response_mask",
        "gradient_accumulation_steps",
        "loss_type",
        "raw_rewards",
        "advantages",
        "old_log_probs",
        "cliprange",
    ],
    "run_masked_normalize": ["tensor", "mask", "dim", "normalize_constant"],
    "get_packed_sft_dataset": ["tokenizer", "dataset_path", "seq_length", "shuffle"],
    "run_iterate_batches": ["dataset", "batch_size", "shuffle"],
    "run_parse_mmlu_response": ["mmlu_example", "model_output"],
    "run_parse_gsm8k_response": ["model_output"],
    "run_compute_per_instance_dpo_loss": [
        "lm",
        "lm_ref",
        "tokenizer",
        "beta",
        "prompt",
        "response_chosen",
        "response_rejected",
    ],
}


def test_every_course_adapter_exists_with_the_course_signature():
    for name, params in COURSE_ADAPTERS.items():
        assert name in cs336.__all__, name
        signature = inspect.signature(getattr(cs336, name))
        assert list(signature.parameters) == params, name
    defaults = {
        "run_masked_mean": {"dim": None},
        "run_masked_normalize": {"dim": None, "normalize_constant": 1.0},
        "run_sft_microbatch_train_step": {"normalize_constant": 1.0},
        "run_grpo_microbatch_train_step": {
            "raw_rewards": None,
            "advantages": None,
            "old_log_probs": None,
            "cliprange": None,
        },
    }
    for name, expected in defaults.items():
        params = inspect.signature(getattr(cs336, name)).parameters
        assert {k: params[k].default for k in expected} == expected, name
    # `from trl_ext.cs336 import *` brings exactly the adapters and the supplement's helpers
    namespace = {}
    exec("from trl_ext.cs336 import *", namespace)
    assert set(COURSE_ADAPTERS) <= set(namespace)


class CharTokenizer:
    """One token per character (id = ord); pad 0, EOS 3 ('\\x03'); adds no special tokens."""

    pad_token_id = 0
    eos_token_id = 3
    eos_token = "\x03"

    def __call__(self, texts, add_special_tokens=True):
        if isinstance(texts, str):
            return {"input_ids": [ord(c) for c in texts]}
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


def test_tokenize_prompt_and_output_by_hand():
    out = cs336.run_tokenize_prompt_and_output(["ab", "a"], ["cd", "b"], CharTokenizer())
    a, b, c, d = (ord(x) for x in "abcd")
    # full sequences: a b c d / a b pad pad; inputs drop the last token, labels the first
    assert out["input_ids"].tolist() == [[a, b, c], [a, b, 0]]
    assert out["labels"].tolist() == [[b, c, d], [b, 0, 0]]
    assert out["response_mask"].tolist() == [[False, True, True], [True, False, False]]


def test_compute_entropy_by_hand():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, -math.inf, -math.inf, -math.inf]]])
    assert cs336.run_compute_entropy(logits)[0].tolist() == pytest.approx([math.log(4), 0.0])  # uniform over 4; one-hot


class ConstantLM(torch.nn.Module):
    """Logits log([0.5, 0.25, 0.125, 0.125]) at every position, whatever the input."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125])))

    def forward(self, input_ids, **kwargs):
        return type("Out", (), {"logits": self.logits.expand(*input_ids.shape, 4)})()


def test_get_response_log_probs_by_hand():
    out = cs336.run_get_response_log_probs(ConstantLM(), torch.tensor([[0, 1]]), torch.tensor([[0, 3]]), True)
    assert out["log_probs"][0].tolist() == pytest.approx([math.log(0.5), math.log(0.125)])
    # entropy = 0.5 ln 2 + 0.25 ln 4 + 2 * 0.125 ln 8 = 1.75 ln 2
    assert out["token_entropy"][0].tolist() == pytest.approx([1.75 * math.log(2)] * 2)
    assert "token_entropy" not in cs336.run_get_response_log_probs(
        ConstantLM(), torch.tensor([[0]]), torch.tensor([[1]]), False
    )


def test_masked_mean_and_normalize_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    assert cs336.run_masked_mean(x, mask).item() == pytest.approx(8 / 3)  # (1 + 3 + 4) / 3
    assert cs336.run_masked_mean(x, mask, dim=1).tolist() == [1.0, 3.5]
    assert cs336.run_masked_mean(x, mask, dim=0).tolist() == [2.0, 4.0]
    assert cs336.run_masked_normalize(x, mask, normalize_constant=2.0).item() == 4.0  # 8 / 2
    assert cs336.run_masked_normalize(x, mask, dim=1, normalize_constant=2.0).tolist() == [0.5, 3.5]
    assert cs336.run_masked_normalize(x, mask, dim=0).tolist() == [4.0, 4.0]


def test_sft_microbatch_train_step_by_hand():
    # per-example sum of -log p over the response: 1 + 2 = 3; / constant 1; batch mean 3; / 2 accumulation = 1.5
    logp = torch.tensor([[-1.0, -2.0, -5.0]], requires_grad=True)
    loss, _ = cs336.run_sft_microbatch_train_step(logp, torch.tensor([[1, 1, 0]]), 2)
    assert loss.item() == 1.5
    assert logp.grad.tolist() == [[-0.5, -0.5, 0.0]]


def test_compute_group_normalized_rewards_by_hand():
    def reward_fn(response, ground_truth):
        r = float(response == ground_truth)
        return {"reward": r, "format_reward": 1.0, "answer_reward": r}

    responses, truths = ["1", "0", "2", "2"], ["1", "1", "2", "2"]
    adv, raw, meta = cs336.run_compute_group_normalized_rewards(reward_fn, responses, truths, 2, 1e-6, True)
    assert raw.tolist() == [1.0, 0.0, 1.0, 1.0]
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.70711 -> +-0.5 / 0.70711 = +-0.70711; group [1, 1] -> 0
    assert adv.tolist() == pytest.approx([0.70711, -0.70711, 0.0, 0.0], abs=1e-5)
    adv, _, _ = cs336.run_compute_group_normalized_rewards(reward_fn, responses, truths, 2, 1e-6, False)
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert isinstance(meta, dict)


def test_policy_gradient_losses_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    assert cs336.run_compute_naive_policy_gradient_loss(torch.tensor([[3.0]]), logp).tolist() == [[3.0, 6.0]]
    # ratio 1.5 with A = 1, eps 0.2: -min(1.5, 1.2) = -1.2; ratio 0.5 with A = -1: -min(-0.5, -0.8) = 0.8
    new = torch.log(torch.tensor([[1.5], [0.5]]))
    loss, meta = cs336.run_compute_grpo_clip_loss(torch.tensor([[1.0], [-1.0]]), new, torch.zeros(2, 1), 0.2)
    assert loss.flatten().tolist() == pytest.approx([-1.2, 0.8])
    assert meta["clipped"].flatten().tolist() == [True, True]
    for loss_type, kwargs, expected in [
        ("no_baseline", {"raw_rewards": torch.tensor([[2.0]])}, [[2.0, 4.0]]),
        ("reinforce_with_baseline", {"advantages": torch.tensor([[-1.0]])}, [[-1.0, -2.0]]),
        # on-policy grpo_clip: ratio 1, loss -A per token
        ("grpo_clip", {"advantages": torch.tensor([[0.5]]), "old_log_probs": logp, "cliprange": 0.2}, [[-0.5, -0.5]]),
    ]:
        loss, _ = cs336.run_compute_policy_gradient_loss(logp, loss_type, **kwargs)
        assert loss.flatten().tolist() == pytest.approx(expected[0]), loss_type


def test_grpo_microbatch_train_step_by_hand():
    # reinforce_with_baseline, A = 2: per-token loss [2, 6, .]; masked_mean over 2 tokens = 4; / 2 accumulation = 2;
    # d loss / d logp = -2 * (1/2 tokens) * (1/2 accumulation) = -0.5 on the response tokens
    logp = torch.tensor([[-1.0, -3.0, -9.0]], requires_grad=True)
    loss, _ = cs336.run_grpo_microbatch_train_step(
        logp, torch.tensor([[1, 1, 0]]), 2, "reinforce_with_baseline", advantages=torch.tensor([[2.0]])
    )
    assert loss.item() == 2.0
    assert logp.grad.tolist() == [[-0.5, -0.5, 0.0]]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_packed_sft_dataset_by_hand(tmp_path):
    rows = [{"prompt": "Add 1 and 2.", "response": "3"}, {"prompt": "Say hi.", "response": "hi"}]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    docs = [cs336.ALPACA_TEMPLATE.format(instruction=r["prompt"], response=r["response"]) for r in rows]
    assert docs[0].endswith("### Instruction:\nAdd 1 and 2.\n\n### Response:\n3")
    stream = [ord(c) for c in docs[0]] + [3] + [ord(c) for c in docs[1]] + [3]  # EOS (3) after each document
    seq = 16
    data = cs336.get_packed_sft_dataset(CharTokenizer(), path, seq, shuffle=False)
    assert len(data) == (len(stream) - 1) // seq  # last partial chunk dropped
    for k in range(len(data)):
        assert data[k]["input_ids"].tolist() == stream[k * seq : (k + 1) * seq]
        assert data[k]["labels"].tolist() == stream[k * seq + 1 : (k + 1) * seq + 1]
        assert data[k]["input_ids"].shape == data[k]["labels"].shape == (seq,)
    # the first document's last character predicts the delimiter
    end = len(docs[0]) - 1
    assert data[end // seq]["labels"][end % seq].item() == 3
    shuffled = cs336.get_packed_sft_dataset(CharTokenizer(), path, seq, shuffle=True)
    assert len(shuffled) == len(data)
    with pytest.raises(ValueError, match="expected string fields 'prompt' and 'response'"):
        cs336.get_packed_sft_dataset(CharTokenizer(), write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}]), 4, False)
    with pytest.raises(ValueError, match="expected at least seq_length"):
        cs336.get_packed_sft_dataset(CharTokenizer(), path, 10_000, False)


def test_iterate_batches_one_epoch(tmp_path):
    rows = [{"prompt": f"Question {i}?", "response": f"Answer {i}."} for i in range(3)]
    data = cs336.get_packed_sft_dataset(CharTokenizer(), write_jsonl(tmp_path / "sft.jsonl", rows), 8, shuffle=False)
    n = len(data)
    batches = list(cs336.run_iterate_batches(data, 4, shuffle=False))
    assert len(batches) == math.ceil(n / 4) == len(cs336.run_iterate_batches(data, 4, shuffle=True))
    assert [b["input_ids"].shape[0] for b in batches] == [4] * (n // 4) + ([n % 4] if n % 4 else [])
    assert batches[0]["input_ids"][1].tolist() == data[1]["input_ids"].tolist()  # unshuffled: in order
    seen = torch.cat([b["input_ids"] for b in cs336.run_iterate_batches(data, 4, shuffle=True)])
    assert sorted(map(tuple, seen.tolist())) == sorted(tuple(data[i]["input_ids"].tolist()) for i in range(n))


def test_parsers_by_hand():
    example = {
        "subject": "zoology",
        "question": "Which barks?",
        "options": ["cat", "dog", "bird", "fish"],
        "answer": "B",
    }
    assert cs336.run_parse_mmlu_response(example, "The correct answer is B.") == "B"
    assert cs336.run_parse_mmlu_response(example, "I am not sure.") is None
    assert cs336.run_parse_gsm8k_response("She has 1,234 apples, then 42.") == "42"
    assert cs336.run_parse_gsm8k_response("no number here") is None


def response_logp_sum(model, tokenizer, prompt, response):
    """Sum of log p(response tokens + EOS | prompt), prompt and response tokenized separately (independent code)."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(response + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + r])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp[len(p) - 1 :].sum()


def test_per_instance_dpo_loss_by_hand(tiny_model, tokenizer):
    # the same model as policy and reference: h = 0, loss = -log sigmoid(0) = log 2
    loss = cs336.run_compute_per_instance_dpo_loss(tiny_model, tiny_model, tokenizer, 0.5, "Say hi.", "Hi!", "No.")
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    # a different reference: -log sigmoid(beta * ((c - c_ref) - (r - r_ref))) with Alpaca-rendered prompts
    ref = type(tiny_model)(tiny_model.config)
    torch.manual_seed(1)
    ref.load_state_dict({k: v + 0.02 * torch.randn_like(v) for k, v in tiny_model.state_dict().items()})
    rendered = cs336.ALPACA_TEMPLATE.format(instruction="Say hi.", response="")
    assert rendered.endswith("### Response:\n")
    with torch.no_grad():
        h = (
            response_logp_sum(tiny_model, tokenizer, rendered, "Hi!")
            - response_logp_sum(ref, tokenizer, rendered, "Hi!")
        ) - (
            response_logp_sum(tiny_model, tokenizer, rendered, "No.")
            - response_logp_sum(ref, tokenizer, rendered, "No.")
        )
    expected = -torch.nn.functional.logsigmoid(0.5 * h)
    loss = cs336.run_compute_per_instance_dpo_loss(tiny_model, ref, tokenizer, 0.5, "Say hi.", "Hi!", "No.")
    assert h.abs() > 1e-3, "the perturbed reference should change the margin, or the test shows nothing"
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
