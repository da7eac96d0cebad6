"""deepspeed_c.launcher: the `deepspeed_c` command (runner.py) and the per-node launcher (launch.py).

Imports nothing of the runtime (and not torch): it only starts, watches and stops processes.
See runner.py for the flags, CPU-only behaviour and exit codes.
"""
