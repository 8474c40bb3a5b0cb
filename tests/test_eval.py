"""trl_ext.eval: course parsers, scoring breakdown, HF generation path, jsonl output, and the eval_math recipe."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset

from trl_ext.eval import (
    evaluate_math,
    generate_completions,
    parse_gsm8k_response,
    parse_mmlu_response,
    resolve_backend,
    score_responses,
    write_jsonl,
)
from trl_ext.rewards import as_course_reward_fn, gsm8k_reward_fn

RECIPES = Path(__file__).parent.parent / "recipes"
FIXTURES = Path(__file__).parent / "fixtures"


# -------------------------------------------------------------------------------------------------------- parsers
@pytest.mark.parametrize(
    "output, expected",
    [
        ("The answer is 1,234.", "1234"),
        ("First 12, then 15", "15"),
        ("It fell to -7 degrees", "-7"),
        ("costs 3.50 dollars", "3.50"),
        ("5-3", "3"),  # the minus of an operation is not a sign
        ("no numbers at all", None),
        ("", None),
    ],
)
def test_parse_gsm8k_response(output, expected):
    assert parse_gsm8k_response(output) == expected


MMLU = {
    "subject": "geography",
    "question": "Capital of Italy?",
    "options": ["Paris", "London", "Rome", "Berlin"],
    "answer": "C",
}


@pytest.mark.parametrize(
    "output, expected",
    [
        ("The correct answer is B", "B"),
        ("The correct answer is B.", "B"),
        ("Answer: (C)", "C"),
        ("answer: D", "D"),
        ("I first thought the answer is A, but the answer is D", "D"),  # the last statement counts
        ("B", "B"),
        (" (A) ", "A"),
        ("C.", "C"),
        ("It is Rome, of course.", "C"),  # one option's text
        ("Either Paris or London.", None),  # two options' texts
        ("I do not know.", None),
        ("The answer is E", None),  # not an option letter
        ("The answer is Berlin", "D"),  # no letter, but one option's text
    ],
)
def test_parse_mmlu_response(output, expected):
    assert parse_mmlu_response(MMLU, output) == expected


@pytest.mark.parametrize("example", [{"question": "q"}, {"options": ["a", "b", "c"]}, {"options": "abcd"}, None])
def test_parse_mmlu_response_rejects_examples_without_four_options(example):
    with pytest.raises(ValueError, match=r"mmlu_example\['options'\] must be a sequence of 4 strings"):
        parse_mmlu_response(example, "The correct answer is A")


# -------------------------------------------------------------------------------------------------------- scoring
def test_score_responses_breakdown_hand_worked():
    responses = ["72", "it is 6", "no idea", "3.0 apples"]
    answers = ["72", "5", "10", "3"]
    result = score_responses(["p0", "p1", "p2", "p3"], responses, answers, gsm8k_reward_fn, num_examples=2)
    # right; number but wrong; no number (unparsed); 3.0 == 3 right
    assert result["accuracy"] == 0.5
    assert result["format_rate"] == 0.75
    assert result["reward"] == 0.5
    assert result["n"] == 4
    assert result["breakdown"] == {
        "format1_answer1": 2,
        "format1_answer0": 1,
        "format0_answer1": 0,
        "format0_answer0": 1,
    }
    assert result["num_unparsed"] == 1
    assert [r["response"] for r in result["unparsed_examples"]] == ["no idea"]
    assert [r["prompt"] for r in result["examples"]] == ["p0", "p1"]
    assert result["records"][3] == {
        "prompt": "p3",
        "response": "3.0 apples",
        "answer": "3",
        "extracted": None,  # no extract_fn: what the grader read is not known, and the record says so
        "extracted_note": "not reported: this task's grader returns its scores, not the answer it read",
        "reward": 1.0,
        "format_reward": 1.0,
        "answer_reward": 1.0,
    }


def test_score_responses_unmeasured_format():
    def exact(prompts, completions, answer, **kwargs):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    result = score_responses(["a", "b"], ["1", "x"], ["1", "2"], as_course_reward_fn(exact))
    assert result["accuracy"] == 0.5
    assert math.isnan(result["format_rate"])
    assert result["num_unparsed"] is None
    assert set(result["breakdown"].values()) == {None}


def test_score_responses_rejects_bad_input():
    with pytest.raises(ValueError, match="expected equal counts"):
        score_responses(["a"], ["1", "2"], ["1", "2"], gsm8k_reward_fn)
    with pytest.raises(ValueError, match="at least one response"):
        score_responses([], [], [], gsm8k_reward_fn)
    with pytest.raises(ValueError, match=r"row 0; missing keys \['format_reward', 'answer_reward'\]"):
        score_responses(["a"], ["1"], ["1"], lambda r, g: {"reward": 1.0})


def test_resolve_backend():
    assert resolve_backend("hf") == "hf"
    expected = "vllm" if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available() else "hf"
    assert resolve_backend("auto") == expected
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("onnx")
    if expected == "hf":
        with pytest.raises((ImportError, RuntimeError), match=r"^backend='vllm': vLLM (is not installed|needs a CUDA)"):
            resolve_backend("vllm")


# ----------------------------------------------------------------------------------------------------- generation
def test_evaluate_math_hf_writes_every_record(tiny_model, tokenizer, tmp_path):
    prompts = [[{"role": "user", "content": q}] for q in ("What is 2 + 2?", "What is 3 + 4?", "Count: 1 2 3")]
    data = Dataset.from_dict({"prompt": prompts, "answer": ["4", "7", "4"]})
    result = evaluate_math(
        tiny_model,
        tokenizer,
        data,
        gsm8k_reward_fn,
        max_new_tokens=6,
        batch_size=2,
        jsonl_path=tmp_path / "r.jsonl",
        disable_progress=True,
    )
    # greedy: the same completions as a direct call, scored one by one with the reward function
    responses = generate_completions(tiny_model, tokenizer, prompts, 6, batch_size=3, disable_progress=True)
    assert [r["response"] for r in result["records"]] == responses
    assert (
        result["accuracy"] == sum(gsm8k_reward_fn(r, a)["answer_reward"] for r, a in zip(responses, data["answer"])) / 3
    )
    assert result["backend"] == "hf" and result["n"] == 3
    tokens = sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in responses)
    assert result["generated_tokens"] == tokens
    assert result["tokens_per_second"] == pytest.approx(tokens / result["seconds"])
    assert result["examples_per_second"] == pytest.approx(3 / result["seconds"])
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert lines == result["records"]
    assert lines[1]["prompt"] == prompts[1]
    assert tokenizer.padding_side == "right"  # restored after left-padded generation


def test_a_user_graders_records_say_the_extracted_answer_is_not_reported(tiny_model, tokenizer):
    """A course-shaped --reward package.module:function returns scores only: each record keeps the row's answer and
    the scores, with "extracted": None and a note saying so; a built-in grader records what it read."""
    from trl_ext import tasks
    from trl_ext.eval import NOT_EXTRACTED
    from trl_ext.rewards import extract_last_number
    from trl_ext.tasks.options import TaskArguments

    data = str(FIXTURES / "data_gsm8k.jsonl")
    user = tasks.load_task(TaskArguments(dataset_name=data, reward="trl_ext.rewards:gsm8k_reward_fn"), 4)
    result = user.evaluate(tiny_model, tokenizer, progress=False)
    record = result["records"][0]
    assert record["extracted"] is None and record["extracted_note"] == NOT_EXTRACTED
    assert record["answer"] == user.test[0]["answer"]
    assert record["reward"] == gsm8k_reward_fn(record["response"], record["answer"])["reward"]
    built_in = tasks.load_task(TaskArguments(dataset_name=data, reward="gsm8k"), 4)
    record = built_in.evaluate(tiny_model, tokenizer, progress=False)["records"][0]
    assert record["extracted"] == extract_last_number(record["response"]) and "extracted_note" not in record


def test_evaluate_math_requires_columns(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="expected a 'answer' column"):
        evaluate_math(tiny_model, tokenizer, Dataset.from_dict({"prompt": ["x"]}), gsm8k_reward_fn, 4)


def test_write_jsonl_creates_parents(tmp_path):
    path = write_jsonl([{"a": 1, "s": "é"}], tmp_path / "x" / "y.jsonl")
    assert path.read_text(encoding="utf-8") == '{"a": 1, "s": "é"}\n'


# --------------------------------------------------------------------------------------------------------- recipe
def test_eval_math_recipe_on_local_gsm8k_jsonl(tiny_model, tokenizer, tmp_path, monkeypatch):
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    monkeypatch.syspath_prepend(str(RECIPES))
    sys.modules.pop("eval_math", None)
    import eval_math

    args = eval_math.EvalArguments(
        dataset_name=str(FIXTURES / "data_gsm8k.jsonl"),
        num_eval=3,
        max_new_tokens=5,
        backend="hf",
        output_dir=str(tmp_path / "out"),
    )
    metrics = eval_math.main(args, trl.ModelConfig(model_name_or_path=str(model_dir)))
    assert metrics["n"] == 3 and metrics["reward"] == "gsm8k"
    assert metrics["dataset"].endswith("data_gsm8k.jsonl") and metrics["backend"] == "hf"
    records = [json.loads(line) for line in (tmp_path / "out" / "responses.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in records] == ["72", "3.75", "4234"]  # GSM8K '#### N' answers, normalized
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert saved["accuracy"] == sum(r["answer_reward"] for r in records) / 3
    assert "records" not in saved
