"""How trl_ext's SFT, DPO and Reward trainers open: after ``check_upstream``, the config they run with.

``DATA_PARAMS`` and ``LOOP_PARAMS`` are the runs of ``transformers.Trainer.__init__`` parameters every TRL 1.16
trainer's ``__init__`` repeats in this order; each trainer's ``_SEAMS`` names its own ``__init__`` with them.
"""

from __future__ import annotations

from typing import Any

from trl_ext.trainers.upstream import config_from_upstream

DATA_PARAMS = ("data_collator", "train_dataset", "eval_dataset", "processing_class")
LOOP_PARAMS = ("compute_metrics", "callbacks", "optimizers")


def opening_args(config_cls: type, model: Any, args: Any, suffix: str) -> Any:
    """``args`` as a ``config_cls``.

    None gives ``config_cls("<model's last path part>-<suffix>")`` (upstream's default output dir, e.g.
    ``SmolLM2-135M-SFT``); an upstream config or plain ``TrainingArguments`` is converted by ``config_from_upstream``;
    a ``config_cls`` is returned as it is.

    Raises:
        TypeError: from ``config_from_upstream``.
    """
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path or "model"
        return config_cls(f"{name.split('/')[-1]}-{suffix}")
    return args if isinstance(args, config_cls) else config_from_upstream(config_cls, args)
