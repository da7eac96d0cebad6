"""fp16 support: DeepSpeed's loss scalers (`deepspeed.runtime.fp16.loss_scaler`)."""
