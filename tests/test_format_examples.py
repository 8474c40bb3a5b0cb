"""A response that repeats its prompt's own example of the answer format gets no format credit (issue 40 item 7).

tests/fixtures/cs336_r1_zero.prompt is the course's cs336_alignment/prompts/r1_zero.prompt (stanford-cs336/
assignment5-alignment at eb2c562), verbatim.
"""

from pathlib import Path

import pytest

from trl_ext import tasks
from trl_ext.data.prompts import R1_ZERO_TEMPLATE
from trl_ext.eval import score_rows
from trl_ext.rewards import r1_zero_reward_fn, template_answer_examples, without_copied_format
from trl_ext.tasks.options import TaskArguments

FIXTURES = Path(__file__).parent / "fixtures"
COURSE_PROMPT = (FIXTURES / "cs336_r1_zero.prompt").read_text()


def test_the_examples_are_what_each_template_shows_inside_its_answer_tags():
    # the course's: "... enclosed within <answer> </answer> tags, respectively, i.e., <think> reasoning process here
    # </think> <answer> answer here </answer>." -- the first pair holds nothing, the second the example
    assert template_answer_examples(COURSE_PROMPT) == {"", "answer here"}
    # trl_ext's r1_zero is the R1 paper's prompt verbatim (Table 1 of DeepSeek-R1), the course's wording too
    assert template_answer_examples(R1_ZERO_TEMPLATE) == {"", "answer here"}
    assert template_answer_examples("... <answer> final result </answer>.\n{question}") == {"final result"}
    assert template_answer_examples("Q: {question}\nA:") == frozenset()


@pytest.mark.parametrize(
    "response, course, ours",
    [
        # the course's example line repeated: well formed for the course's grader, format 0 here
        (" reasoning process here </think> <answer> answer here </answer>", (0.0, 1.0, 0.0), (0.0, 0.0, 0.0)),
        (" x </think> <answer>  Answer   here </answer>", (0.0, 1.0, 0.0), (0.0, 0.0, 0.0)),  # spacing, case
        # an empty answer, as the template's "enclosed within <answer> </answer> tags" shows: no answer either
        (" 9 * 2 </think> <answer> </answer>", (0.0, 1.0, 0.0), (0.0, 0.0, 0.0)),
        # a real answer, even after copying the reasoning part: counted
        (" reasoning process here </think> <answer> 18 </answer>", (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)),
        (" 16 - 3 - 4 = 9, 9 * 2 = 18 </think> <answer> 17 </answer>", (0.0, 1.0, 0.0), (0.0, 1.0, 0.0)),
        (" no tags at all", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
    ],
)
def test_a_copied_example_has_no_format_and_the_rest_is_the_graders(response, course, ours):
    keys = ("reward", "format_reward", "answer_reward")
    assert tuple(r1_zero_reward_fn(response, "18")[k] for k in keys) == course
    graded = without_copied_format(r1_zero_reward_fn, COURSE_PROMPT)
    assert tuple(graded(response, "18")[k] for k in keys) == ours


def test_a_template_without_an_example_keeps_the_grader_itself():
    assert without_copied_format(r1_zero_reward_fn, "chat") is r1_zero_reward_fn


@pytest.mark.parametrize("template", [str(FIXTURES / "cs336_r1_zero.prompt"), "r1_zero"])
def test_a_math_tasks_format_rate_does_not_count_the_templates_example(template):
    """The held-out format rate is the mean format_reward of the task's judge: with the course's prompt file (or
    trl_ext's r1_zero template) a response that repeats the example answer counts as unformatted."""
    args = TaskArguments(dataset_name=str(FIXTURES / "data_gsm8k.jsonl"), template=template)
    task = tasks.load_task(args, max_new_tokens=32)
    row = dict(task.test[0])
    example = max(template_answer_examples(COURSE_PROMPT if template != "r1_zero" else R1_ZERO_TEMPLATE))
    copied = f" reasoning </think> <answer> {example} </answer>"
    right = f" reasoning </think> <answer> {row['answer']} </answer>"
    assert task.score(copied, row) == {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}
    assert task.score(right, row) == {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}
    assert score_rows([row, row], [copied, right], task.score)["format_rate"] == 0.5  # what evaluation reports
