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
    R1_ZERO_STOP,
    R1_ZERO_TEMPLATE,
    TEMPLATES,
    adds_bos_token,
    chat_messages,
    format_prompt,
    prompt_token_ids,
    render_chat_prompt,
    strip_leading_bos,
    template_stop_strings,
)

__all__ = [
    "ANSWER_WITH_NUMBER",
    "HUB_DEFAULT_CONFIGS",
    "KINDS",
    "LOCAL_FORMATS",
    "OPERATIONS",
    "PHRASINGS",
    "R1_ZERO_STOP",
    "R1_ZERO_TEMPLATE",
    "TEMPLATES",
    "adds_bos_token",
    "canonical_problem",
    "chat_messages",
    "format_prompt",
    "infer_kind",
    "is_test_problem",
    "load_math_dataset",
    "make_arithmetic_dataset",
    "prompt_token_ids",
    "render_chat_prompt",
    "strip_leading_bos",
    "template_stop_strings",
]
