"""ZenFlow (DeepSpeed's `deepspeed.runtime.zenflow`): ZeRO-Offload whose device steps the most important
gradient columns every step while the host steps the rest from an accumulated gradient every few steps."""
