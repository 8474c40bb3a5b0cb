"""TRL's names of ``trl_ext.GRPOConfig``'s course settings, resolved both ways.

- ``loss_type`` -> ``length_normalization`` (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: claimed by the
  aggregations) or ``pg_loss_type`` plus its normalization (``cispo``, ``sapo``, ``vespo``: claimed by the losses);
- ``scale_rewards`` -> ``normalize_by_std`` (``group``/True, ``none``/False), ``batch`` ->
  ``advantage_estimator="batch_std"``;
- ``multi_objective_aggregation="normalize_then_sum"`` -> ``advantage_estimator="normalize_then_sum"``.

Either name decides, with TRL's meaning; neither gives the course default; both must agree, else one ValueError
(:func:`resolve_objective`, :func:`resolve_advantages`). The other names are derived and marked :class:`Derived`
(re-derived by ``dataclasses.replace``). :func:`upstream_meaning` serves ``trl_ext.cli.parse``.
"""

from __future__ import annotations

from typing import Any

from trl_ext.objective.advantages import ADVANTAGE_ESTIMATORS, DEFAULT_ADVANTAGE_ESTIMATOR
from trl_ext.objective.aggregations import AGGREGATIONS, upstream_loss_types
from trl_ext.objective.losses import POLICY_LOSSES, PolicyLoss

__all__ = ["UPSTREAM_OPTIONS", "upstream_objectives", "loss_type_of", "upstream_meaning"]

DEFAULT_POLICY_LOSS = "grpo_clip"
DEFAULT_LENGTH_NORMALIZATION = "masked_mean"

UPSTREAM_OPTIONS: dict[str, tuple[str, ...]] = {
    "loss_type": ("pg_loss_type", "length_normalization"),
    "scale_rewards": ("normalize_by_std", "advantage_estimator"),
    "multi_objective_aggregation": ("advantage_estimator",),
}
"""TRL's name -> the course fields its values may decide."""

SCALE_REWARDS: dict[str, dict[str, Any]] = {
    "group": {"normalize_by_std": True},
    "none": {"normalize_by_std": False},
    "batch": {"advantage_estimator": "batch_std", "normalize_by_std": True},
}
MULTI_OBJECTIVE_AGGREGATION: dict[str, dict[str, Any]] = {
    "sum_then_normalize": {},
    "normalize_then_sum": {"advantage_estimator": "normalize_then_sum"},
}
ALWAYS_SCALED = ("batch_std", "normalize_then_sum")
"""Estimators that always divide by a std: ``normalize_by_std=False`` conflicts with them."""


class Derived(str):
    """An option value that ``GRPOConfig.__post_init__`` filled in (from the other name of the same setting, or the
    course default), as opposed to one the user gave. Equal to, hashed and JSON-encoded as the plain string.
    ``dataclasses.replace`` passes every field back to ``__init__``; this type is how the new config knows that the
    value was derived, not given."""

    __slots__ = ()


_Derived = Derived  # the name configs pickled before issue 46 refer to (training_args.bin of older checkpoints)


def _given(value: Any) -> Any:
    return None if isinstance(value, Derived) else value


def upstream_objectives() -> dict[str, dict[str, str]]:
    """TRL's ``loss_type`` -> the course fields it decides, from the registries now: ``{"length_normalization": ...}``
    for a loss type an aggregation claims (``dapo``: ``token_mean``), plus ``"pg_loss_type"`` for one a loss claims
    (``cispo``: ``cispo`` with ``token_mean``)."""
    meaning = {name: {"length_normalization": agg} for name, agg in upstream_loss_types().items()}
    for name, entry in POLICY_LOSSES.items():
        if entry.upstream_loss_type:
            meaning[entry.upstream_loss_type] = {
                "pg_loss_type": name,
                "length_normalization": entry.length_normalization or DEFAULT_LENGTH_NORMALIZATION,
            }
    return meaning


def loss_type_of(pg_loss_type: str, length_normalization: str) -> str | None:
    """TRL's ``loss_type`` of this loss and length normalization, or None where TRL has none (a user's entry, or a
    loss with a TRL name of its own under another normalization: ``cispo`` with ``masked_mean``)."""
    loss = POLICY_LOSSES.get(pg_loss_type)
    if loss.upstream_loss_type:
        paired = loss.length_normalization or DEFAULT_LENGTH_NORMALIZATION
        return loss.upstream_loss_type if length_normalization == paired else None
    return AGGREGATIONS.get(length_normalization).upstream_loss_type


def _scale_rewards(value: Any) -> Any:
    """TRL's bools (and their text, from a command line) as TRL's strings."""
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):
        return "group" if str(value).lower() == "true" else "none"
    return value


def upstream_meaning(name: str, value: Any) -> dict[str, Any] | None:
    """The course fields TRL's option ``name`` set to ``value`` decides, or None for a value TRL does not have
    (the config refuses it).

    ``loss_type="cispo"`` -> ``{"pg_loss_type": "cispo", "length_normalization": "token_mean"}``;
    ``loss_type="dapo"`` -> ``{"length_normalization": "token_mean"}`` (the loss stays what it is);
    ``scale_rewards="batch"`` -> ``{"advantage_estimator": "batch_std", "normalize_by_std": True}``.
    """
    if name == "loss_type":
        return upstream_objectives().get(value)
    if name == "scale_rewards":
        return SCALE_REWARDS.get(_scale_rewards(value))
    if name == "multi_objective_aggregation":
        return MULTI_OBJECTIVE_AGGREGATION.get(value)
    raise KeyError(f"{name!r} is not one of TRL's names of a course setting ({', '.join(UPSTREAM_OPTIONS)})")


def _fields(meaning: dict[str, Any]) -> str:
    return " and ".join(f"{field}={value!r}" for field, value in meaning.items())


def _conflict(upstream: str, value: Any, field: str, given: Any, meant: Any, replayed: bool) -> ValueError:
    hint = (
        " (dataclasses.replace passes every field again: to change this setting give its new value under one name "
        "and None under the other)"
        if replayed
        else ""
    )
    return ValueError(
        f"{upstream}={value!r} conflicts with {field}={given!r}: {upstream} is TRL's name for {field}, and "
        f"{upstream}={value!r} means {field}={meant!r}; give one of the two{hint}"
    )


def _replayed(config: Any) -> bool:
    names = {*UPSTREAM_OPTIONS, *(field for fields in UPSTREAM_OPTIONS.values() for field in fields)}
    return any(isinstance(getattr(config, name), Derived) for name in names)


def resolve_objective(config: Any) -> PolicyLoss:
    """Set ``pg_loss_type``, ``length_normalization`` and ``loss_type`` of ``config`` (a ``trl_ext.GRPOConfig`` in
    its ``__post_init__``) by the rule of this module, and return the loss's registry entry.

    Raises:
        ValueError: an unknown loss, normalization or TRL loss type (naming the choices), or names that disagree
            (naming both).
    """
    replayed = _replayed(config)
    loss_type = _given(config.loss_type)
    given = {"pg_loss_type": _given(config.pg_loss_type), "length_normalization": _given(config.length_normalization)}
    if given["pg_loss_type"] is not None:
        POLICY_LOSSES.get(given["pg_loss_type"])
    if given["length_normalization"] is not None:
        AGGREGATIONS.get(given["length_normalization"])
    chosen = dict(given)
    if loss_type is not None:
        objectives = upstream_objectives()
        if loss_type not in objectives:
            raise ValueError(
                f"loss_type={loss_type!r} is not supported: expected one of TRL's loss types, each of which "
                "trl_ext.GRPOTrainer maps onto pg_loss_type and length_normalization: "
                + "; ".join(f"{name!r} (= {_fields(meaning)})" for name, meaning in objectives.items())
            )
        meaning = objectives[loss_type]
        for field, meant in meaning.items():
            if given[field] is not None and given[field] != meant:
                raise _conflict("loss_type", loss_type, field, given[field], meant, replayed)
            chosen[field] = given[field] or meant
    pg_loss_type = chosen["pg_loss_type"] or DEFAULT_POLICY_LOSS
    loss = POLICY_LOSSES.get(pg_loss_type)
    length_normalization = chosen["length_normalization"] or loss.length_normalization or DEFAULT_LENGTH_NORMALIZATION
    AGGREGATIONS.get(length_normalization)
    named = loss_type_of(pg_loss_type, length_normalization)
    if loss_type is not None and named != loss_type:
        hint = " (dataclasses.replace passes every field again: give None for the other)" if replayed else ""
        raise ValueError(
            f"loss_type={loss_type!r} conflicts with pg_loss_type={pg_loss_type!r}: loss_type={loss_type!r} means "
            f"{_fields(upstream_objectives()[loss_type])}"
            + ("" if "pg_loss_type" in upstream_objectives()[loss_type] else " for a loss without a TRL name")
            + f", while pg_loss_type={pg_loss_type!r} with length_normalization={length_normalization!r} is "
            + (f"TRL's loss_type={named!r}" if named else "none of TRL's loss types")
            + f"; give one of the two{hint}"
        )
    config.pg_loss_type = given["pg_loss_type"] or Derived(pg_loss_type)
    config.length_normalization = given["length_normalization"] or Derived(length_normalization)
    config.loss_type = loss_type if loss_type is not None else (Derived(named) if named else None)
    return loss


def resolve_advantages(config: Any, loss: PolicyLoss) -> None:
    """Set ``advantage_estimator``, ``normalize_by_std``, ``scale_rewards`` and ``multi_objective_aggregation`` of
    ``config`` by the rule of this module, given its loss (``no_baseline`` is defined with ``raw_rewards``).

    Raises:
        ValueError: an unknown estimator or TRL value (naming the choices), names that disagree, or an estimator the
            loss refuses (naming both).
    """
    replayed = _replayed(config)
    scale = _scale_rewards(_given(config.scale_rewards))
    aggregation = _given(config.multi_objective_aggregation)
    if scale is not None and scale not in SCALE_REWARDS:
        raise ValueError(
            f"scale_rewards={scale!r} is not supported: expected TRL's 'group' or True (= normalize_by_std=True), "
            "'none' or False (= normalize_by_std=False), or 'batch' (= advantage_estimator='batch_std')"
        )
    if aggregation is not None and aggregation not in MULTI_OBJECTIVE_AGGREGATION:
        raise ValueError(
            f"multi_objective_aggregation={aggregation!r} is not supported: expected TRL's 'sum_then_normalize' "
            "(every estimator but normalize_then_sum) or 'normalize_then_sum' (= advantage_estimator="
            "'normalize_then_sum')"
        )
    values = {"advantage_estimator": _given(config.advantage_estimator), "normalize_by_std": config.normalize_by_std}
    if values["advantage_estimator"] is not None:
        ADVANTAGE_ESTIMATORS.get(values["advantage_estimator"])
    decided_by: dict[str, tuple[str, Any]] = {}
    claims = [("scale_rewards", scale, SCALE_REWARDS.get(scale, {}))]
    claims.append(("multi_objective_aggregation", aggregation, MULTI_OBJECTIVE_AGGREGATION.get(aggregation, {})))
    for upstream, value, meaning in claims:
        for field, meant in meaning.items():
            if values[field] is None:
                values[field], decided_by[field] = meant, (upstream, value)
            elif values[field] != meant:
                if field in decided_by:  # two TRL names disagree
                    other, other_value = decided_by[field]
                    raise ValueError(
                        f"{upstream}={value!r} conflicts with {other}={other_value!r}: {upstream}={value!r} means "
                        f"{field}={meant!r} and {other}={other_value!r} means {field}={values[field]!r}; give one "
                        "of the two"
                    )
                raise _conflict(upstream, value, field, values[field], meant, replayed)
    estimator = values["advantage_estimator"]
    # TRL's names that decide no estimator still name one: scale_rewards group/none is the group std (or none),
    # multi_objective_aggregation sum_then_normalize is not normalize_then_sum
    for upstream, value, named in (
        ("scale_rewards", scale, "batch_std" if scale in ("group", "none") else None),
        (
            "multi_objective_aggregation",
            aggregation,
            "normalize_then_sum" if aggregation == "sum_then_normalize" else None,
        ),
    ):
        if named is not None and estimator == named:
            raise ValueError(
                f"{upstream}={value!r} conflicts with advantage_estimator={estimator!r}: {upstream} is TRL's name for "
                f"the advantage, and advantage_estimator={estimator!r} is TRL's "
                + (
                    "scale_rewards='batch'"
                    if named == "batch_std"
                    else "multi_objective_aggregation='normalize_then_sum'"
                )
                + "; give one of the two"
            )
    if estimator is not None and loss.advantage_estimator is not None and estimator != loss.advantage_estimator:
        said = (
            f"{decided_by['advantage_estimator'][0]}={decided_by['advantage_estimator'][1]!r} (advantage_estimator="
            f"{estimator!r})"
            if "advantage_estimator" in decided_by
            else f"advantage_estimator={estimator!r}"
        )
        raise ValueError(
            f"{said} conflicts with pg_loss_type={config.pg_loss_type!r}, a loss defined with advantage_estimator="
            f"{loss.advantage_estimator!r}: leave advantage_estimator unset, or choose another pg_loss_type "
            "('reinforce_with_baseline' is -A log p with any advantage)"
        )
    in_use = estimator or loss.advantage_estimator or DEFAULT_ADVANTAGE_ESTIMATOR
    if in_use in ALWAYS_SCALED and values["normalize_by_std"] is False:
        upstream, value = decided_by.get("normalize_by_std", ("normalize_by_std", False))
        raise ValueError(
            f"{upstream}={value!r} conflicts with advantage_estimator={in_use!r}, which always divides by a std "
            "(TRL ignores scale_rewards under multi_objective_aggregation='normalize_then_sum'; trl_ext refuses a "
            f"setting it would ignore); leave {upstream} unset"
        )
    config.advantage_estimator = _given(config.advantage_estimator) or Derived(in_use)
    config.normalize_by_std = True if values["normalize_by_std"] is None else values["normalize_by_std"]
    derived_scale = "batch" if in_use == "batch_std" else "group" if config.normalize_by_std else "none"
    config.scale_rewards = scale if scale is not None else Derived(derived_scale)
    derived_aggregation = "normalize_then_sum" if in_use == "normalize_then_sum" else "sum_then_normalize"
    config.multi_objective_aggregation = aggregation if aggregation is not None else Derived(derived_aggregation)


class OptionLayers:
    """A recipe's option layers merged under TRL's naming rule: recipe defaults < ``--config`` files < flags
    (``trl_ext.cli.parse``), for configs with TRL's names of course settings (:data:`UPSTREAM_OPTIONS`).

    A layer's TRL name stands for the course fields its value decides (:func:`upstream_meaning`: ``loss_type
    cispo`` decides both ``pg_loss_type`` and ``length_normalization``, ``dapo`` the latter alone), so it replaces
    what lower layers set of those fields under either name; a lower layer's TRL name overridden in part keeps
    deciding the rest, as course fields.

    Args:
        trl_names: whether TRL's names apply (a recipe whose config has them); False: a plain merge.

    Attributes:
        merged: option -> value, the layers so far.
        source: option -> where its value came from (the layer's ``where``).
    """

    def __init__(self, trl_names: bool = True):
        self.names = UPSTREAM_OPTIONS if trl_names else {}
        self.merged: dict[str, Any] = {}
        self.source: dict[str, str] = {}

    def _decided(self, key: str, value: Any) -> dict[str, Any]:
        """The course fields ``key=value`` decides: itself for a course field; for a TRL name what its value means
        (every field it may decide, for a value it does not have: the config then names it)."""
        if key not in self.names:
            return {key: value}
        meaning = upstream_meaning(key, value)
        return dict.fromkeys(self.names[key]) if meaning is None else meaning

    def overridden_by(self, layer: dict[str, Any]) -> None:
        """Drop what ``layer`` (a higher one: a file, or the flags) decides under the other name."""
        fields = {field for key, value in layer.items() for field in self._decided(key, value)}
        for key in [k for k in self.merged if k not in layer]:
            if key in fields:  # a course field the layer decides
                self.merged.pop(key)
            elif key in self.names:
                below = self._decided(key, self.merged[key])
                if below.keys() & fields:  # a TRL name the layer overrides, in part: the rest as course fields
                    self.merged.pop(key)
                    for field, value in below.items():
                        if field not in fields and value is not None:
                            self.merged.setdefault(field, value)

    def add(self, layer: dict[str, Any], where: str) -> None:
        """Merge ``layer`` (from ``where``) above the layers so far."""
        self.overridden_by(layer)
        self.merged.update(layer)
        self.source.update(dict.fromkeys(layer, where))
