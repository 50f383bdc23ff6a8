"""Logging setup: one dictConfig, a request id carried in a contextvar and added by a filter."""

from __future__ import annotations

import contextvars
import logging
import logging.config

__all__ = ["REQUEST_ID", "RequestIdFilter", "configure_logging"]

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` from the current request's context."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def configure_logging(level: str) -> None:
    """Configure the root handler once; called by the entry point only."""
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "filters": {"request_id": {"()": RequestIdFilter}},
            "formatters": {
                "plain": {
                    "format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"
                }
            },
            "handlers": {
                "stderr": {
                    "class": "logging.StreamHandler",
                    "formatter": "plain",
                    "filters": ["request_id"],
                }
            },
            "root": {"level": level.upper(), "handlers": ["stderr"]},
            "loggers": {
                "uvicorn.access": {"level": "WARNING"},
                "httpx": {"level": "WARNING"},
                "httpcore": {"level": "WARNING"},
            },
        }
    )
