"""robosuite's own log, quiet unless asked for.

robosuite logs through one logger (``"robosuite_logs"``, configured by its first import with
a console handler at level INFO): warnings about a missing private macro file and optional
robot models when it is imported, then one "Loading controller configuration" line per
simulator, about 50 lines before a robosuite run prints anything of its own.
:func:`quiet_robosuite_logging`, which
:class:`~torchrl_flowpolicy.tasks.robosuite.env.RobosuiteGymEnv` calls before it imports
robosuite, lets only its errors through. The environment variable
:data:`LOG_LEVEL_VARIABLE` (``TORCHRL_FLOWPOLICY_ROBOSUITE_LOG_LEVEL``) set to a level name
(``DEBUG``, ``INFO``, ``WARNING``, ...) shows robosuite's records from that level up;
collector processes inherit it, and a change takes effect at the next record.

Examples:
    >>> import logging
    >>> quiet_robosuite_logging()
    >>> logger = logging.getLogger("robosuite_logs")
    >>> info = logger.makeRecord(logger.name, logging.INFO, "", 0, "Loading ...", (), None)
    >>> logger.filter(info)  # dropped: the variable is unset, robosuite's errors only
    False
"""

from __future__ import annotations

import logging
import os

__all__ = ["LOG_LEVEL_VARIABLE", "quiet_robosuite_logging"]

#: The environment variable that sets the lowest level of robosuite's log records shown
#: (a ``logging`` level name such as ``INFO``, or a number); unset: ``ERROR``.
LOG_LEVEL_VARIABLE = "TORCHRL_FLOWPOLICY_ROBOSUITE_LOG_LEVEL"
# robosuite's logger (robosuite.utils.log_utils.ROBOSUITE_DEFAULT_LOGGER).
_ROBOSUITE_LOGGER = "robosuite_logs"


def _robosuite_log_level() -> int:
    """The level of :data:`LOG_LEVEL_VARIABLE` (``ERROR`` when unset)."""
    value = os.environ.get(LOG_LEVEL_VARIABLE, "").strip() or "ERROR"
    level = int(value) if value.isdigit() else logging.getLevelName(value.upper())
    if not isinstance(level, int):
        raise ValueError(
            f"{LOG_LEVEL_VARIABLE}={value!r} is not a logging level: use DEBUG, INFO, "
            "WARNING, ERROR or CRITICAL (or unset it: robosuite's errors only)."
        )
    return level


class _RobosuiteLogFilter(logging.Filter):
    """Drops robosuite's records below :data:`LOG_LEVEL_VARIABLE`'s level (read per record,
    so that changing the variable takes effect at once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= _robosuite_log_level()


def quiet_robosuite_logging() -> None:
    """Install :class:`_RobosuiteLogFilter` on robosuite's logger, before robosuite is
    imported (its import logs too). A logger's filters outlive robosuite's own set-up, which
    only adds a handler and sets the level."""
    _robosuite_log_level()  # a bad value fails here, not inside logging
    logger = logging.getLogger(_ROBOSUITE_LOGGER)
    if not any(isinstance(item, _RobosuiteLogFilter) for item in logger.filters):
        logger.addFilter(_RobosuiteLogFilter())
