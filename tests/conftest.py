"""Shared test setup: exposes the real-ComfyUI server fixture (tests/comfyui_env.py) to every test module."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:  # helper modules are imported by file name whatever pytest's import mode
    sys.path.insert(0, _TESTS)

from comfyui_env import comfyui_server  # noqa: F401  (pytest fixture)
