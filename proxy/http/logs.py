"""Structured logs: one JSON object per line. Never log keys or message content at info."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

LOGGER_NAME = "memproxy"
_RESERVED = frozenset(vars(logging.makeLogRecord({})))


class JSONFormatter(logging.Formatter):
    """Render a record and its `extra` fields as one JSON line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str) -> None:
    """Send memproxy's logs to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter())
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def get_logger(name: str) -> logging.Logger:
    """A child of memproxy's logger."""
    return logging.getLogger(f"{LOGGER_NAME}.{name}")
