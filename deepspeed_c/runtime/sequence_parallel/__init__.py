"""deepspeed.runtime.sequence_parallel: Ulysses sequence parallelism for Hugging Face models (ALST)."""
