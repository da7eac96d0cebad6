"""SuperOffload (DeepSpeed's `deepspeed.runtime.superoffload`): ZeRO-3 offload whose host optimizer steps
speculatively while backward runs, rolled back when the step's overflow or clipping check says otherwise."""
