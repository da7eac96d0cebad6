"""DeepCompile's graph passes (DeepSpeed's deepspeed.compile.passes): where the ZeRO-3 ops go in the graph."""
