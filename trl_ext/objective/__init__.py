"""GRPO's objective as registered choices, each entry a thin call of :mod:`trl_ext.functional`: policy losses
(``losses``), aggregations or length normalization (``aggregations``), advantage estimators (``advantages``); the
course's helpers beyond what the trainers run (``course``, re-exported by :mod:`trl_ext.cs336`); and the one module
that knows TRL's option names and how they map onto the course's (``trl_names``)."""

# every room of the package is reachable as an attribute once any of it is imported (a recipe's
# ``trl_ext.objective.course.mean_response_entropy`` must not depend on what else happened to import it)
from trl_ext.objective import advantages, aggregations, course, losses, trl_names

__all__ = ["advantages", "aggregations", "course", "losses", "trl_names"]
