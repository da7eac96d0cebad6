"""The Muon optimizer (DeepSpeed 0.19.8's deepspeed.runtime.zero.muon): MuonWithAuxAdam (muon_optimizer.py),
the update functions (original_muon.py), Newton-Schulz (newton_schulz.py), the ZeRO partition exchange
(partitioned.py) and the config's param groups (param_groups.py)."""
