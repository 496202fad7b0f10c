"""One log format for every process, so interleaved output from `specserve up` reads well."""

from __future__ import annotations

import logging
import os
import time


def setup_logging(component: str) -> None:
    level = os.environ.get("SPECSERVE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {component:<7} %(levelname)s %(name)s: %(message)s")


class RateLimitedLog:
    """A warning at most once per interval (a failure that hits every session's round at
    once); the next one says how many were suppressed."""

    def __init__(self, logger: logging.Logger, interval_s: float = 5.0):
        self._log = logger
        self._interval_s = interval_s
        self._next_at = 0.0
        self._suppressed = 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now < self._next_at:
            self._suppressed += 1
            return
        if self._suppressed:
            message += f" ({self._suppressed} more like it in the last {self._interval_s:.0f} s)"
        self._log.warning(message, *args)
        self._next_at, self._suppressed = now + self._interval_s, 0
