"""Arms: named GRPO settings, their presets, and the config each one trains with."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import trl

from trl_ext.trainers import GRPOConfig, GRPOTrainer

TRAINERS = {"trl": (trl.GRPOTrainer, trl.GRPOConfig), "trl_ext": (GRPOTrainer, GRPOConfig)}
"""Arm trainer name -> (trainer class, config class)."""

UPSTREAM_REQUIRED = ("loss_type", "scale_rewards", "beta", "epsilon")
"""Fields an upstream (``trainer="trl"``) arm must set explicitly."""

TRL_ADVANTAGE_EPS = 1e-4
"""What ``trl.GRPOTrainer`` adds to the group std before dividing (hard-coded in ``_generate_and_score_completions``,
TRL 1.16; not a config field). trl_ext's ``advantage_eps`` defaults to the course's 1e-6."""

TRL_UPDATE_FIELDS = (
    "loss_type",
    "scale_rewards",
    "beta",
    "epsilon",
    "epsilon_high",
    "num_iterations",
    "mask_truncated_completions",
    "top_entropy_quantile",
    "importance_sampling_level",
    "use_bias_correction_kl",
    "activation_checkpointing",
)
"""The ``trl.GRPOConfig`` fields that decide how a batch of rollouts becomes an update (loss and its token average,
advantage scaling, clipping, KL, reuse of samples, masking) or what a step costs (gradient checkpointing): the
``trl`` preset takes each from TRL's defaults (:func:`trl_defaults`)."""


def trl_defaults(config_cls: type = trl.GRPOConfig) -> dict[str, Any]:
    """TRL's default value of each of :data:`TRL_UPDATE_FIELDS`, read from ``config_cls``'s dataclass fields.

    ``activation_checkpointing`` is what transformers resolves when neither name is given: the deprecated
    ``gradient_checkpointing`` default (True for ``trl.GRPOConfig``) where the new name's default is None, else
    False. (How checkpointing recomputes, ``activation_checkpointing_kwargs``, stays the comparison's.) Read from the
    installed TRL, so a TRL release that changes a default changes the presets built from it.

    Returns:
        field name -> default value, for every name of :data:`TRL_UPDATE_FIELDS`.
    """
    fields = {f.name: f for f in dataclasses.fields(config_cls)}

    def default(name):
        f = fields[name]
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    values = {name: default(name) for name in TRL_UPDATE_FIELDS if name != "activation_checkpointing"}
    checkpointing = default("activation_checkpointing")  # transformers: the old name counts only when this is None
    values["activation_checkpointing"] = bool(
        checkpointing if checkpointing is not None else default("gradient_checkpointing")
    )
    return values


def trl_ext_at_trl_defaults(upstream: Mapping[str, Any]) -> dict[str, Any]:
    """The trl_ext settings that compute what upstream computes at ``upstream`` (from :func:`trl_defaults`).

    TRL's ``loss_type`` and ``scale_rewards`` become the course fields they decide (``GRPOConfig.upstream_meaning``:
    'dapo' -> ``length_normalization='token_mean'``, 'cispo' -> ``pg_loss_type='cispo'`` with 'token_mean', 'group'
    -> ``normalize_by_std=True``), with the GRPO-Clip loss where the loss type names none and TRL's advantage eps
    (:data:`TRL_ADVANTAGE_EPS`); every other field keeps TRL's value. A value TRL does not have is passed on as is,
    and ``trl_ext.GRPOConfig`` refuses it, naming it, when the arm's config is built.
    """
    settings: dict[str, Any] = {"pg_loss_type": "grpo_clip", "advantage_eps": TRL_ADVANTAGE_EPS}
    for name, value in upstream.items():
        meaning = GRPOConfig.upstream_meaning(name, value) if name in GRPOConfig.UPSTREAM_OPTIONS else None
        if meaning is None:  # not one of TRL's names of a course setting, or a value TRL does not have (refused)
            settings[name] = value
        else:
            settings.update(meaning)
    return settings


_TRL_DEFAULTS = trl_defaults()

ARM_PRESETS: dict[str, dict[str, Any]] = {
    # Upstream TRL as a TRL user runs it: trl.GRPOConfig's defaults for every field of TRL_UPDATE_FIELDS (TRL 1.16:
    # loss_type dapo, scale_rewards group, beta 0, epsilon 0.2, one iteration, gradient checkpointing on).
    "trl": {"trainer": "trl", **_TRL_DEFAULTS},
    # trl_ext.GRPOTrainer at the same upstream defaults: the same math (token_mean = dapo, std scaling with TRL's
    # eps 1e-4, checkpointing on), so the pair trl / trl_ext compares the trainers, not the settings.
    "trl_ext": {"trainer": "trl_ext", **trl_ext_at_trl_defaults(_TRL_DEFAULTS)},
    # Upstream TRL, GRPO as in DeepSeekMath: group-std-normalized advantages, per-response token mean, no KL (the
    # course arm's math up to advantage_eps; written out, not TRL's defaults).
    "trl_grpo": {"trainer": "trl", "loss_type": "grpo", "scale_rewards": "group", "beta": 0.0, "epsilon": 0.2},
    # The course's defaults: GRPO-Clip, std normalization, masked_mean.
    "course": {
        "trainer": "trl_ext",
        "pg_loss_type": "grpo_clip",
        "normalize_by_std": True,
        "length_normalization": "masked_mean",
        "beta": 0.0,
        "epsilon": 0.2,
    },
    "no_std": {
        "trainer": "trl_ext",
        "pg_loss_type": "grpo_clip",
        "normalize_by_std": False,
        "beta": 0.0,
        "epsilon": 0.2,
    },
    "masked_normalize": {
        "trainer": "trl_ext",
        "pg_loss_type": "grpo_clip",
        "length_normalization": "masked_normalize",
        "beta": 0.0,
        "epsilon": 0.2,
    },
    # Dr. GRPO (Liu et al. 2025): no std division, sum over tokens / max_completion_length.
    "dr_grpo": {
        "trainer": "trl_ext",
        "pg_loss_type": "grpo_clip",
        "normalize_by_std": False,
        "length_normalization": "masked_normalize",
        "beta": 0.0,
        "epsilon": 0.2,
    },
    # Course defaults plus a k3 KL penalty to the initial policy (TRL reloads the reference from the policy's path).
    "kl_k3": {"trainer": "trl_ext", "pg_loss_type": "grpo_clip", "beta": 0.04, "kl_estimator": "k3", "epsilon": 0.2},
}
"""Named arms usable as ``arms: [trl, trl_ext, course, ...]``; a mapping ``{preset: course, name: ..., field: value}``
extends one. ``trl`` and ``trl_ext`` take :data:`TRL_UPDATE_FIELDS` from the installed TRL's defaults
(:func:`trl_defaults`; ``trl_ext`` also TRL's hard-coded advantage eps), everything else from the shared config; the
others are the course's settings and upstream GRPO written out (``trl_grpo``).
"""

_DERIVED_FIELDS = (
    "generation_batch_size",
    "loss_type",
    "scale_rewards",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
)


# ------------------------------------------------------------------------------------------------------------ arms
@dataclasses.dataclass
class Arm:
    """One setting of a comparison.

    Attributes:
        name: label in tables and plots, and the arm's output sub-directory; unique within a comparison.
        trainer: ``"trl"`` (upstream ``trl.GRPOTrainer``) or ``"trl_ext"``.
        settings: config fields this arm sets on top of the shared config (e.g. ``{"normalize_by_std": False}``).
        task: name of a task variant (prompts, reward functions, held-out evaluation) given to
            :func:`trl_ext.compare.run_comparison` in ``tasks``; None (default) = the comparison's own data.
    """

    name: str
    trainer: str
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    task: str | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in "/\\ "):
            raise ValueError(f"arm name {self.name!r}: expected a non-empty string without spaces or slashes")
        if self.task is not None and (not isinstance(self.task, str) or not self.task):
            raise ValueError(f"arm {self.name!r}: task={self.task!r}; expected None or a non-empty task name")
        if self.trainer not in TRAINERS:
            raise ValueError(f"arm {self.name!r}: trainer={self.trainer!r}; expected one of {sorted(TRAINERS)}")
        config_cls = TRAINERS[self.trainer][1]
        known = {f.name for f in dataclasses.fields(config_cls) if f.init}
        unknown = sorted(set(self.settings) - known)
        if unknown:
            raise ValueError(
                f"arm {self.name!r}: {unknown} are not fields of {config_cls.__module__}.{config_cls.__name__}"
            )
        if self.trainer == "trl":
            missing = [k for k in UPSTREAM_REQUIRED if k not in self.settings]
            if missing:
                raise ValueError(
                    f"upstream arm {self.name!r} must set {list(UPSTREAM_REQUIRED)} explicitly; missing {missing}"
                )
        else:
            derived = [k for k in ("loss_type", "scale_rewards") if k in self.settings]
            if derived:
                raise ValueError(
                    f"arm {self.name!r} (trl_ext) sets {derived}, TRL's names for length_normalization and "
                    "normalize_by_std; trl_ext arms set the course names, so that arms compare in one vocabulary"
                )


def parse_arms(
    specs: Sequence[str | Mapping[str, Any]], presets: Mapping[str, Mapping[str, Any]] = ARM_PRESETS
) -> list[Arm]:
    """Build arms from preset names and/or mappings.

    Each spec is a preset name from ``presets`` (default :data:`ARM_PRESETS`), a mapping, or a JSON object string. A
    mapping holds ``name``, optionally ``preset`` to start from, ``trainer`` (default: the preset's, else
    ``"trl_ext"``), ``task`` and config fields overriding the preset's.

    Raises:
        ValueError: unknown preset, a mapping without ``name``, a repeated name, or an invalid arm (see :class:`Arm`).
    """
    arms: list[Arm] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, str) and spec.lstrip().startswith("{"):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as err:
                raise ValueError(f"arm {i}: invalid JSON {spec!r}: {err}") from None
        if isinstance(spec, str):
            if spec not in presets:
                raise ValueError(f"arm {i}: unknown preset {spec!r}; expected one of {sorted(presets)} or a mapping")
            settings = dict(presets[spec])
            arms.append(Arm(spec, settings.pop("trainer"), settings, settings.pop("task", None)))
            continue
        if not isinstance(spec, Mapping) or "name" not in spec:
            raise ValueError(f"arm {i}: expected a preset name or a mapping with a 'name', got {spec!r}")
        spec = dict(spec)
        name, preset = spec.pop("name"), spec.pop("preset", None)
        if preset is not None and preset not in presets:
            raise ValueError(f"arm {name!r}: unknown preset {preset!r}; expected one of {sorted(presets)}")
        settings = dict(presets[preset]) if preset else {}
        trainer = spec.pop("trainer", settings.pop("trainer", "trl_ext"))
        settings.pop("trainer", None)
        task = spec.pop("task", settings.pop("task", None))
        settings.update(spec)
        arms.append(Arm(name, trainer, settings, task))
    names = [a.name for a in arms]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"arm names must be unique; repeated: {repeated}")
    if not arms:
        raise ValueError("expected at least one arm")
    return arms


def arm_config(base: trl.GRPOConfig, arm: Arm) -> trl.GRPOConfig:
    """The config of ``arm``: the shared ``base`` with the arm's settings, output under ``base.output_dir/arm.name``.

    Fields of ``base`` that differ from their defaults are carried over, except those ``__post_init__`` derives and
    ``loss_type``/``scale_rewards`` (set or derived per arm); ``run_name`` becomes the arm's name.

    Raises:
        ValueError: ``base`` sets ``loss_type`` or ``scale_rewards`` away from TRL's defaults (set them per arm).
    """
    for name in ("loss_type", "scale_rewards"):
        default = next(f.default for f in dataclasses.fields(trl.GRPOConfig) if f.name == name)
        if getattr(base, name) != default:
            raise ValueError(
                f"the shared config sets {name}={getattr(base, name)!r}; set it per arm instead (upstream arms write "
                f"out {list(UPSTREAM_REQUIRED)}, trl_ext arms derive it)"
            )
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(trl.GRPOConfig):
        if not f.init or f.name in _DERIVED_FIELDS:
            continue
        value = getattr(base, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value != default:
            kwargs[f.name] = value
    kwargs.update(output_dir=str(Path(base.output_dir) / arm.name), run_name=arm.name)
    kwargs.update(arm.settings)
    return TRAINERS[arm.trainer][1](**kwargs)


def arm_key(arm: Arm, base: trl.GRPOConfig) -> str:
    """What an arm trains, independent of its name: trainer, task and the settings that differ from ``base``.

    Arms with the same key train the same way, so several comparisons sharing a ``cache``
    (:func:`trl_ext.compare.run_comparison`) train each key once.
    """
    changed = {k: v for k, v in sorted(arm.settings.items()) if not hasattr(base, k) or getattr(base, k) != v}
    return json.dumps({"trainer": arm.trainer, "task": arm.task, "settings": changed}, sort_keys=True, default=str)
