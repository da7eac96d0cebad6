"""deepspeed_c.profiling.flops_profiler: DeepSpeed's flops profiler API (see profiler.py)."""
from deepspeed_c.profiling.flops_profiler.profiler import (FlopsProfiler, get_model_profile, get_module_duration,
                                                           get_module_flops, get_module_macs)
from deepspeed_c.profiling.flops_profiler.units import (bytes_to_string, duration_to_string, flops_to_string,
                                                        macs_to_string, number_to_string, params_to_string)

__all__ = ["FlopsProfiler", "get_model_profile", "get_module_flops", "get_module_macs", "get_module_duration",
           "number_to_string", "macs_to_string", "flops_to_string", "params_to_string", "duration_to_string",
           "bytes_to_string"]
