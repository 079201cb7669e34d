"""Logging set-up: `log_format: text | json` to stderr, one logger per module."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        document = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        # A record's facts as JSON (the access log's): a callable given the record's
        # time, so that a text log never pays for making them.
        fields = getattr(record, "fields", None)
        if fields is not None:
            document.update(fields(record.created))
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document)


def configure(log_format: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("lbproxy")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
