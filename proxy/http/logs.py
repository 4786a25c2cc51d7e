"""Structured logs: one JSON object per line (MEMPROXY_LOG_FORMAT=json, the default) or a
line for a terminal (text). Never log keys or message content at info."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

LOGGER_NAME = "memproxy"
# The OpenTelemetry SDK's and exporters' loggers (a collector down, a full span queue):
# their records go out in memproxy's format, not as Python's plain-text last resort.
OTEL_LOGGER = "opentelemetry"
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


class TextFormatter(logging.Formatter):
    """Render a record for a terminal: time, level, logger, message, then key=value fields."""

    def format(self, record: logging.LogRecord) -> str:
        when = self.formatTime(record, "%H:%M:%S")
        fields = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _RESERVED)
        line = f"{when} {record.levelname.lower():7} {record.name} {record.getMessage()}"
        line = f"{line} {fields}" if fields else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(level: str, line_format: str = "json") -> None:
    """Send memproxy's logs to stderr as JSON lines (or, `text`, lines for a terminal)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter() if line_format == "text" else JSONFormatter())
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    sdk = logging.getLogger(OTEL_LOGGER)
    sdk.handlers[:] = [handler]
    sdk.setLevel(max(logging.WARNING, logger.level))  # its info lines are the SDK's own chatter
    sdk.propagate = False


def get_logger(name: str) -> logging.Logger:
    """A child of memproxy's logger."""
    return logging.getLogger(f"{LOGGER_NAME}.{name}")
