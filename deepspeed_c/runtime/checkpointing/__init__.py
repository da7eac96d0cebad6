"""Checkpoint files of the runtime: the engine's save/load (engine), ZeRO 1/2 and 3 optimizer files (zero,
zero3), MoE experts (moe), node-local storage (nodes), the pipeline's (pipeline, pipeline_layers,
pipeline_reshard), the AutoTP full view (tensor_parallel), the reducer order file, the collective guard
that makes a rank's failure every rank's, and the typed inputs they get (options, states). Pure layout and
resharding live in deepspeed_c/checkpoint/."""
