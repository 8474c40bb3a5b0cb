"""Verifiable reward functions for math answers, in both the TRL and the course (CS336) shapes.

TRL shape (``trl.GRPOTrainer(reward_funcs=...)``): ``r1_zero_reward``, ``gsm8k_reward``, ``math_reward``,
``arithmetic_reward`` -- ``(prompts, completions, **columns) -> list[float]``, ground truth from the ``answer`` column.

Course shape (``reward_fn(response, ground_truth) -> {"reward", "format_reward", "answer_reward"}``):
``r1_zero_reward_fn``, ``gsm8k_reward_fn`` (also grades the arithmetic problems), ``math_reward_fn``.

Adapters: ``as_trl_reward`` (course -> TRL), ``as_trl_row_reward`` (a scorer of whole rows -> TRL) and
``as_course_reward_fn`` (TRL -> course); ``carry_reserved_columns`` / ``restore_carried_columns`` move the columns
TRL keeps from reward functions (``TRL_RESERVED_COLUMNS``) under names it passes on.
"""

from trl_ext.rewards.adapters import (
    REWARD_KEYS,
    TRL_RESERVED_COLUMNS,
    TRUNCATION_KEYWORD,
    as_course_reward_fn,
    as_trl_reward,
    as_trl_row_reward,
    carry_reserved_columns,
    completion_text,
    dataset_columns,
    restore_carried_columns,
    without_credit,
)
from trl_ext.rewards.format_examples import copies_template_example, template_answer_examples, without_copied_format
from trl_ext.rewards.math_answers import (
    MATH_VERIFY_TIMEOUT_S,
    arithmetic_reward,
    extract_answer_tag,
    extract_boxed,
    extract_boxed_answer,
    extract_boxed_parts,
    extract_last_number,
    extract_math_answer,
    grade_math_answer,
    gsm8k_reward,
    gsm8k_reward_fn,
    math_reward,
    math_reward_fn,
    normalize_number_text,
    numbers_equal,
    parse_gsm8k_ground_truth,
    r1_zero_reward,
    r1_zero_reward_fn,
    to_decimal,
)

__all__ = [
    "MATH_VERIFY_TIMEOUT_S",
    "REWARD_KEYS",
    "TRL_RESERVED_COLUMNS",
    "TRUNCATION_KEYWORD",
    "arithmetic_reward",
    "as_course_reward_fn",
    "as_trl_reward",
    "as_trl_row_reward",
    "carry_reserved_columns",
    "dataset_columns",
    "restore_carried_columns",
    "completion_text",
    "copies_template_example",
    "extract_answer_tag",
    "extract_boxed",
    "extract_boxed_answer",
    "extract_boxed_parts",
    "extract_last_number",
    "extract_math_answer",
    "grade_math_answer",
    "gsm8k_reward",
    "gsm8k_reward_fn",
    "math_reward",
    "math_reward_fn",
    "normalize_number_text",
    "numbers_equal",
    "parse_gsm8k_ground_truth",
    "r1_zero_reward",
    "r1_zero_reward_fn",
    "template_answer_examples",
    "to_decimal",
    "without_copied_format",
    "without_credit",
]

# Sorting toy task of the lecture (shaped vs all-or-nothing reward).
from trl_ext.rewards.sorting import (  # noqa: E402
    parse_number_list,
    sort_exact_match,
    sort_exact_reward,
    sort_exact_reward_fn,
    sort_inclusion_ordering_reward,
    sort_shaped_reward,
    sort_shaped_reward_fn,
)

__all__ += [
    "parse_number_list",
    "sort_exact_match",
    "sort_exact_reward",
    "sort_exact_reward_fn",
    "sort_inclusion_ordering_reward",
    "sort_shaped_reward",
    "sort_shaped_reward_fn",
]
