"""Imported by the test harness's rank server (tests/harness.py, _context) before tests.harness_freeze:
deepspeed_c's engine and ZeRO modules (harness.PRELOADED_DSC), so that every rank forked from the server starts
with them loaded. The server must outlive a failing import (a tree in the middle of an edit): the ranks then
import the module themselves and each test reports the error."""
import importlib

from tests.harness import PRELOADED_DSC

for _name in PRELOADED_DSC:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 (reported by the ranks' own import)
        pass
