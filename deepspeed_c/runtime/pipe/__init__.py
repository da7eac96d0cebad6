"""Pipeline parallelism (`deepspeed.runtime.pipe`)."""
