"""deepspeed_c.autotuning: `deepspeed_c --autotuning tune|run` (autotuner.py) and the engine's side
of the `autotuning` section (metrics.py)."""
