"""Client libraries imported on first use instead of at collection.

Every xdist worker imports every test module to collect the whole suite, so a module-level
`pytest.importorskip("litellm")` costs both workers its import (LiteLLM, the Agents SDK,
pydantic-ai, LangChain, lm-eval and anthropic: about 7 s of CPU each), though only the worker
that runs those files uses them. `lazy("litellm")` stands in for the module and imports it when
a test first reads an attribute of it; a missing package then skips that test.
"""

from __future__ import annotations

import gc
import importlib
import sys
from types import ModuleType

import pytest


class LazyModule:
    """`name`, imported (or the test skipped) when an attribute of it is first read."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            # What collection probes every module-level object for (`__test__`, fixture
            # markers): a stand-in has none of them, and answering must not import.
            raise AttributeError(attr)
        if self._module is None:
            self._module = load(self._name)
        return getattr(self._module, attr)


def lazy(name: str) -> LazyModule:
    return LazyModule(name)


def load(name: str) -> ModuleType:
    """`name` imported now, or the running test skipped when it is not installed."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        pytest.skip(f"could not import {name!r}: {exc}")
    # conftest.py froze what collection imported, so that the gc.collect of each in-process
    # engine load does not scan it again; a big library imported later is frozen as well.
    gc.collect()
    gc.freeze()
    return module
