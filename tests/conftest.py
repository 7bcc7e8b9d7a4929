"""Shared test setup: exposes the real-ComfyUI server fixture (tests/comfyui_env.py) to every test module.

``MGPU_TESTS_STRICT=1`` (set by .ci/run) fails every test that would skip: CI has ComfyUI, Chromium and every test
dependency, so a skip there means a tier silently stopped running.
"""

import os
import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:  # helper modules are imported by file name whatever pytest's import mode
    sys.path.insert(0, _TESTS)

from comfyui_env import comfyui_server  # noqa: E402,F401  (pytest fixture)

STRICT = os.environ.get("MGPU_TESTS_STRICT") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under MGPU_TESTS_STRICT=1, where every tier must run: {reason}"
