"""deepspeed_c.profiling: the flops profiler (deepspeed.profiling's module path)."""
