"""The data-efficiency data sampler and the memory-mapped index files it reads (DeepSpeed's formats)."""
