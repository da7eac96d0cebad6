"""deepspeed_c.launcher: the `deepspeed_c` command (runner.py) and the per-node launcher (launch.py).

Imports nothing of the runtime (and not torch): it only starts, watches and stops processes.
See runner.py for the flags, CPU-only behaviour and exit codes.
"""

from deepspeed_c._lazy import lazy_exports as _lazy_exports

# submodules resolve on attribute access, as after DeepSpeed's eager imports
__getattr__, __dir__ = _lazy_exports(__name__, {})
