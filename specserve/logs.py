"""One log format for every process, so interleaved output from `specserve up` reads well."""

from __future__ import annotations

import logging
import os


def setup_logging(component: str) -> None:
    level = os.environ.get("SPECSERVE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {component:<7} %(levelname)s %(name)s: %(message)s")
