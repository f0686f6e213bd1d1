"""Logging for every kvplane process: one call at start-up, text or JSON lines.

Log records carry identifiers and counts only; no prompt or completion text is ever
passed to a logger (the proxy and agent log token counts, never tokens).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from kvplane.core.config import LoggingSettings

_STANDARD_ATTRIBUTES = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line; `extra={...}` fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update((k, v) for k, v in record.__dict__.items() if k not in _STANDARD_ATTRIBUTES)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(settings: LoggingSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if settings.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level)
    # httpx and its fork httpx2 (the tools' clients, the openai client's) log every
    # request at INFO: thousands a minute under a benchmark's load.
    for chatty in ("httpx", "httpcore", "httpx2", "httpcore2"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))
