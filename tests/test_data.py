"""Tests for trl_ext.data: prompt templates, GSM8K/MATH loaders on small local files, arithmetic generator."""

from __future__ import annotations

import json
import operator
import re
from pathlib import Path

import pytest
from datasets import Dataset

import trl_ext.data.math_datasets as math_datasets
from trl_ext.data import (
    ANSWER_WITH_NUMBER,
    R1_ZERO_TEMPLATE,
    canonical_problem,
    format_prompt,
    is_test_problem,
    load_math_dataset,
    make_arithmetic_dataset,
    render_chat_prompt,
)
from trl_ext.rewards import arithmetic_reward, gsm8k_reward, math_reward, r1_zero_reward

FIXTURES = Path(__file__).parent / "fixtures"
GSM8K = FIXTURES / "data_gsm8k.jsonl"
MATH = FIXTURES / "data_math.json"
MATH500 = FIXTURES / "data_math500.jsonl"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ------------------------------------------------------------------------------------------------ prompts
def test_format_prompt_templates():
    q = "What is 23 + 45?"
    r1 = format_prompt(q, "r1_zero")
    assert r1 == R1_ZERO_TEMPLATE.replace("{question}", q)
    assert r1.endswith("\nUser: What is 23 + 45?\nAssistant: <think>")
    assert "<answer> </answer>" in r1
    assert format_prompt(f"  {q} ", "question_only") == q
    assert format_prompt(q, "question_only", instruction=ANSWER_WITH_NUMBER) == q + "\nAnswer with just the number."
    assert format_prompt(q, "chat") == [{"role": "user", "content": q}]
    assert format_prompt(q, "chat", system_prompt="Be brief.", instruction="Just the number.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": q + "\nJust the number."},
    ]


def test_format_prompt_errors():
    with pytest.raises(ValueError, match=r"template must be one of \('r1_zero', 'question_only', 'chat'\)"):
        format_prompt("q", "alpaca")
    with pytest.raises(ValueError, match="system_prompt is only supported by template='chat'"):
        format_prompt("q", "r1_zero", system_prompt="s")
    with pytest.raises(ValueError, match="question must be a non-empty string"):
        format_prompt("  ", "chat")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from trl_ext.models import load_tokenizer

    return load_tokenizer()  # the embedded SmolLM2-135M-Instruct tokenizer (local, no hub access)


def test_render_chat_prompt_with_the_real_tokenizer(smollm2_tokenizer):
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat_prompt(smollm2_tokenizer, "What is 2 + 3?", system_prompt="Be brief.") == expected
    assert format_prompt("What is 2 + 3?", "chat", smollm2_tokenizer, system_prompt="Be brief.") == expected
    # the tokenizer is only used by the chat template
    assert format_prompt("What is 2 + 3?", "question_only", smollm2_tokenizer) == "What is 2 + 3?"


def test_render_chat_prompt_needs_a_chat_template():
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="has no chat_template"):
        render_chat_prompt(NoTemplate(), "q")


# ------------------------------------------------------------------------------------------------ loaders
def test_load_gsm8k_jsonl():
    ds = load_math_dataset(GSM8K)  # kind inferred from question + answer
    assert ds["answer"] == ["72", "3.75", "4234", "-5"]
    assert ds["question"][0].startswith("A baker makes 24 rolls")
    assert ds["solution"][0].endswith("#### 72")  # the worked solution is kept
    assert ds["prompt"][0] == [{"role": "user", "content": ds["question"][0]}]
    # the answer column is the reward functions' ground truth
    completions = ["so 72 rolls", "$3.750", "4,234 residents", "It is 5 degrees"]
    assert gsm8k_reward(ds["prompt"], completions, **{"answer": ds["answer"]}) == [1.0, 1.0, 1.0, 0.0]


def test_load_math_json_boxed_solution():
    ds = load_math_dataset(MATH, template="r1_zero")
    assert ds["answer"] == [r"\frac{1}{2}", "4", r"\frac{\sqrt{2}}{2}"]  # last box, nested braces
    assert ds["level"] == ["Level 1", "Level 1", "Level 2"]  # other columns kept
    assert ds["prompt"][1].endswith("User: What is $\\sqrt{16}$?\nAssistant: <think>")
    assert r1_zero_reward(
        ds["prompt"],
        [" 2/4 </think> <answer>0.5</answer>", " </think> <answer>4</answer>", " </think> <answer>1/2</answer>"],
        answer=ds["answer"],
    ) == [1.0, 1.0, 0.0]


def test_load_math_prefers_answer_column():
    ds = load_math_dataset(MATH500, template="question_only")
    assert ds["answer"] == ["2", r"\frac{1}{2}"]
    assert ds["prompt"] == ["Compute $1 + 1$.", "Find $x$ if $2x = 1$."]
    assert math_reward(ds["prompt"], [r"\boxed{2}", r"\boxed{0.5}"], answer=ds["answer"]) == [1.0, 1.0]


def test_load_parquet_and_max_rows(tmp_path):
    path = tmp_path / "gsm.parquet"
    Dataset.from_list([json.loads(line) for line in GSM8K.read_text().splitlines()]).to_parquet(str(path))
    ds = load_math_dataset(path, max_rows=2, template="question_only", instruction=ANSWER_WITH_NUMBER)
    assert ds["answer"] == ["72", "3.75"]
    assert ds["prompt"][1] == "Tom buys 3 pens at $1.25 each. How much does he spend?\nAnswer with just the number."


def test_load_arithmetic_file(tmp_path):
    path = write_jsonl(
        tmp_path / "arith.jsonl",
        [{"question": "What is 2 + 3?", "answer": 5}, {"question": "What is 9 - 4?", "answer": "5.0"}],
    )
    ds = load_math_dataset(path, kind="arithmetic")
    assert ds["answer"] == ["5", "5"]
    # the same file read as gsm8k has no "####" answers: the error says what to do
    with pytest.raises(ValueError, match=r"row 0 \(0-based\), field 'answer'.*kind='arithmetic'"):
        load_math_dataset(path)


BAD_ROWS = [
    {"question": "Good one?", "answer": "x\n#### 7"},
    {"question": "No marker?", "answer": "it is 7"},
    {"question": "", "answer": "#### 3"},
    {"question": "Null answer?", "answer": None},
    {"question": "Good two?", "answer": "#### 1,000"},
]


def test_bad_row_error_names_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(path))}: line 2, row 1 \(0-based\), field 'answer': .*'####'"
    ):
        load_math_dataset(path)
    only_question_bad = write_jsonl(tmp_path / "bad_q.jsonl", [BAD_ROWS[0], BAD_ROWS[2]])
    with pytest.raises(ValueError, match=r"bad_q.jsonl: line 2, row 1 \(0-based\), field 'question': is empty"):
        load_math_dataset(only_question_bad)
    null_answer = write_jsonl(tmp_path / "bad_null.jsonl", [BAD_ROWS[3]])
    with pytest.raises(ValueError, match=r"bad_null.jsonl: line 1, row 0 \(0-based\), field 'answer': is missing"):
        load_math_dataset(null_answer)
    math_no_box = write_jsonl(tmp_path / "nobox.jsonl", [{"problem": "p", "solution": "it is \\boxed{3"}])
    with pytest.raises(ValueError, match=r"nobox.jsonl: line 1, row 0 \(0-based\), field 'solution': has no complete"):
        load_math_dataset(math_no_box)


def test_skip_bad_rows_warns_once_with_the_count(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    with pytest.warns(
        UserWarning, match=r"skipped 3 bad row\(s\) of 5; first: row 1 \(0-based\), field 'answer'"
    ) as record:
        ds = load_math_dataset(path, skip_bad_rows=True)
    assert len([w for w in record if "skipped" in str(w.message)]) == 1
    assert ds["question"] == ["Good one?", "Good two?"]
    assert ds["answer"] == ["7", "1000"]


def test_loader_argument_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_math_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unsupported local dataset"):
        load_math_dataset(tmp_path)  # an existing directory
    with pytest.raises(ValueError, match=r"dataset kind 'mmlu' is not supported \(--dataset_kind, kind=\)"):
        load_math_dataset(GSM8K, kind="mmlu")
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"text": "hi", "label": 1}])
    with pytest.raises(ValueError, match=r"odd.jsonl: cannot infer the dataset kind from columns \['text', 'label'\]"):
        load_math_dataset(odd)
    with pytest.raises(ValueError, match=r"math data needs a column 'problem'; found columns \['text', 'label'\]"):
        load_math_dataset(odd, kind="math")
    no_answer = write_jsonl(tmp_path / "no_answer.jsonl", [{"problem": "p", "level": "1"}])
    with pytest.raises(ValueError, match=r"math data needs a column 'answer' or 'solution'"):
        load_math_dataset(no_answer)
    with pytest.raises(ValueError, match="max_rows must be None or >= 1"):
        load_math_dataset(GSM8K, max_rows=0)
    all_bad = write_jsonl(tmp_path / "all_bad.jsonl", [BAD_ROWS[1]])
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no usable rows"):
        load_math_dataset(all_bad, skip_bad_rows=True)


def test_hub_id_goes_to_load_dataset_with_the_default_gsm8k_config(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return Dataset.from_list([{"question": "What is 1 + 1?", "answer": "#### 2"}])

    monkeypatch.setattr(math_datasets, "load_dataset", fake_load_dataset)
    ds = load_math_dataset("openai/gsm8k", split="test")
    load_math_dataset("someone/math-set", split="train", config_name="algebra")
    assert calls == [("openai/gsm8k", "main", "test"), ("someone/math-set", "algebra", "train")]
    assert ds["answer"] == ["2"]


# ------------------------------------------------------------------------------------------ arithmetic
_PLAIN = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def plain_problem(question: str) -> tuple[int, str, int]:
    match = _PLAIN.fullmatch(question)
    assert match, question
    return int(match[1]), match[2], int(match[3])


def test_arithmetic_default_is_plain_two_digit_addition():
    ds = make_arithmetic_dataset(200, seed=0)
    assert ds.column_names == ["prompt", "answer", "question"]
    for row in ds:
        a, op, b = plain_problem(row["question"])
        assert op == "+" and 10 <= a <= 99 and 10 <= b <= 99
        assert row["answer"] == str(a + b)
        assert row["prompt"] == [{"role": "user", "content": row["question"]}]
    assert len(set(ds["question"])) == 200
    assert arithmetic_reward(ds["prompt"][:2], [f"= {ds['answer'][0]}", "= 1000"], answer=ds["answer"][:2]) == [
        1.0,
        0.0,
    ]


def test_arithmetic_is_deterministic_by_seed():
    first = make_arithmetic_dataset(50, seed=7)
    assert first.to_list() == make_arithmetic_dataset(50, seed=7).to_list()
    assert first["question"] != make_arithmetic_dataset(50, seed=8)["question"]


def test_arithmetic_train_and_test_never_share_a_problem():
    def keys(ds):
        return {canonical_problem(*plain_problem(q)) for q in ds["question"]}

    train = keys(make_arithmetic_dataset(2000, seed=0, split="train"))
    test_a = keys(make_arithmetic_dataset(1000, seed=0, split="test"))
    test_b = keys(make_arithmetic_dataset(1000, seed=1, split="test"))
    assert len(train) > 1000 and len(test_a) > 500
    assert not train & test_a
    assert not train & test_b
    # 23 + 45 and 45 + 23 are one problem and share a split
    assert canonical_problem(45, "+", 23) == canonical_problem(23, "+", 45) == "23 + 45"
    assert all(is_test_problem(a, "+", b) == is_test_problem(b, "+", a) for a in range(10, 100) for b in range(10, 100))
    # about test_fraction of the 4095 unordered two-digit pairs are test problems
    pairs = [(a, b) for a in range(10, 100) for b in range(a, 100)]
    assert len(pairs) == 4095
    share = sum(is_test_problem(a, "+", b, test_fraction=0.2) for a, b in pairs) / len(pairs)
    assert 0.17 < share < 0.23


def test_arithmetic_operations_and_digits():
    ds = make_arithmetic_dataset(300, seed=3, operations=("+", "-", "*"), digits=(3, 1), template="question_only")
    seen_ops = set()
    for row in ds:
        a, op, b = plain_problem(row["question"])
        seen_ops.add(op)
        assert int(row["answer"]) == _OPS[op](a, b)
        if op == "-":
            assert int(row["answer"]) >= 0  # operands ordered when allow_negative=False
        else:
            assert 100 <= a <= 999 and 0 <= b <= 9
        assert row["prompt"] == row["question"]
    assert seen_ops == {"+", "-", "*"}
    neg = make_arithmetic_dataset(200, seed=0, operations=("-",), allow_negative=True)
    assert any(int(x) < 0 for x in neg["answer"])


def test_arithmetic_word_problems():
    ds = make_arithmetic_dataset(60, seed=5, operations=("+", "-", "*"), phrasing="word")
    for q, ans in zip(ds["question"], ds["answer"], strict=True):
        a, b = (int(x) for x in re.findall(r"\d+", q))
        expected = a + b if "more" in q else a - b if "away" in q else a * b
        assert int(ans) == expected, q
        assert "?" in q and "What is" not in q


def test_arithmetic_errors():
    with pytest.raises(ValueError, match="could draw only .* distinct test problems of the 1000 asked"):
        make_arithmetic_dataset(1000, seed=0, split="test", digits=1)  # only ~20 of 100 one-digit sums are test
    with pytest.raises(ValueError, match="operations must be a non-empty subset"):
        make_arithmetic_dataset(5, operations=("/",))
    with pytest.raises(ValueError, match="digits must be an int in 1..9"):
        make_arithmetic_dataset(5, digits=0)
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        make_arithmetic_dataset(5, split="validation")
    with pytest.raises(ValueError, match="phrasing must be one of"):
        make_arithmetic_dataset(5, phrasing="poem")
    with pytest.raises(ValueError, match="test_fraction must be in"):
        make_arithmetic_dataset(5, test_fraction=1.0)
    with pytest.raises(ValueError, match="allow_negative=True with phrasing='word'"):
        make_arithmetic_dataset(5, operations=("-",), phrasing="word", allow_negative=True)
    with pytest.raises(ValueError, match="n must be >= 1"):
        make_arithmetic_dataset(0)
