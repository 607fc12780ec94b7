"""Fault hooks of the agent, as ``RESILRUN_FAULTS`` is for workers: delays that tests and benchmarks
set on one node to get a lagging replica or a slow upload on purpose. Unset, they cost nothing;
a value that is not a number of seconds is refused, never ignored."""

from __future__ import annotations

import logging

from resilrun.env import fault_hook_setting
from resilrun.errors import ResilrunError

logger = logging.getLogger(__name__)

# Every replica push of this agent waits this long before its bytes (a slow link).
REPLICATION_DELAY_ENV = "RESILRUN_FAULT_REPLICATION_DELAY_S"
# Every upload to the persistent tier waits this long before it starts (a slow storage link).
PERSIST_DELAY_ENV = "RESILRUN_FAULT_PERSIST_DELAY_S"


def delay_s(name: str, what: str) -> float:
    """The hook ``name``'s delay (0: unset); ``what`` is said in the warning that it is on."""
    raw = fault_hook_setting(name)
    if not raw:
        return 0.0
    try:
        delay = float(raw)
    except ValueError:
        raise ResilrunError(f"{name}={raw!r} is not a number of seconds") from None
    logger.warning("fault hook: %s waits %.2f s (%s)", what, delay, name)
    return delay
