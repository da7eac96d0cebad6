"""DeepCompile (DeepSpeed's deepspeed.compile): ZeRO as passes over the graph torch.compile captures.
init_z3 builds the ZeRO-3 runner; custom_ops holds the graph operations; passes/ places them. AutoSP
(compile.passes ["autosp"]): init_sp's backend, sp_ops' operations, passes/sp_compile."""
