"""Math datasets for TRL: prompt templates, GSM8K / MATH loaders and a seeded arithmetic generator.

Every dataset has a ``prompt`` column (plain string or conversation, see ``format_prompt``) and an ``answer``
column with the normalized ground truth that the reward functions in ``trl_ext.rewards`` grade against.
"""

from trl_ext.data.arithmetic import (
    OPERATIONS,
    PHRASINGS,
    canonical_problem,
    is_test_problem,
    make_arithmetic_dataset,
)
from trl_ext.data.math_datasets import HUB_DEFAULT_CONFIGS, KINDS, LOCAL_FORMATS, infer_kind, load_math_dataset
from trl_ext.data.prompts import (
    ANSWER_WITH_NUMBER,
    R1_ZERO_TEMPLATE,
    TEMPLATES,
    chat_messages,
    format_prompt,
    render_chat_prompt,
)

__all__ = [
    "ANSWER_WITH_NUMBER",
    "HUB_DEFAULT_CONFIGS",
    "KINDS",
    "LOCAL_FORMATS",
    "OPERATIONS",
    "PHRASINGS",
    "R1_ZERO_TEMPLATE",
    "TEMPLATES",
    "canonical_problem",
    "chat_messages",
    "format_prompt",
    "infer_kind",
    "is_test_problem",
    "load_math_dataset",
    "make_arithmetic_dataset",
    "render_chat_prompt",
]
