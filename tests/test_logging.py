"""Every module logs through memproxy's logger tree, so configure_logging formats it all
(tests/test_process.py reads such lines from a real server's log)."""

from __future__ import annotations

import importlib
import logging
import pkgutil
from types import ModuleType

import config
import memory
import proxy
from proxy.http.logs import LOGGER_NAME


def all_modules() -> list[ModuleType]:
    modules = []
    for package in (config, memory, proxy):
        for found in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not found.name.endswith(".__main__"):  # that one runs the command line
                modules.append(importlib.import_module(found.name))
    return modules


def test_every_logger_of_ours_is_under_memproxy() -> None:
    loggers = {
        module.__name__: value for module in all_modules() for value in vars(module).values()
        if isinstance(value, logging.Logger)
    }
    # The scan sees the modules the issue was about (wherever the packages put them).
    assert any("jobs" in name for name in loggers), loggers
    assert any("embeddings" in name for name in loggers), loggers
    outside = {name: lg.name for name, lg in loggers.items()
               if not lg.name.startswith(f"{LOGGER_NAME}.")}
    assert outside == {}, f"module loggers outside {LOGGER_NAME!r}: {outside}"
    # Nor a logger any module created some other way.
    ours = ("config", "memory", "proxy")
    stray = [name for name in logging.root.manager.loggerDict
             if name in ours or name.startswith(tuple(f"{p}." for p in ours))]
    assert stray == [], f"loggers outside {LOGGER_NAME!r}: {stray}"
