"""DeepSpeed's data pipeline (runtime/data_pipeline): curriculum schedules, the data-efficiency sampler
and random layerwise token dropping, under DeepSpeed's module paths."""
