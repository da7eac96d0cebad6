#!/usr/bin/env python
"""Convert a ZeRO checkpoint into plain PyTorch weights of a chosen dtype:

    python zero_to_torch.py <checkpoint_dir> <output_dir> --dtype bf16 [--safe_serialization] [--tag TAG]

Copied beside zero_to_fp32.py into every checkpoint directory (DeepSpeed's layout), so it runs from
there with no package installed; it uses that zero_to_fp32.py (its conversion and its command line)."""
from __future__ import annotations

if __package__:
    from . import zero_to_fp32
else:  # run as a copied script: its sibling is importable from the script's own directory
    import zero_to_fp32  # type: ignore[no-redef]


def main(argv: list[str] | None = None) -> None:
    args = zero_to_fp32.build_parser("Convert a ZeRO checkpoint into plain PyTorch weights of a chosen dtype.",
                                     "directory for the converted weights",
                                     dtypes=zero_to_fp32.OUTPUT_DTYPE_NAMES).parse_args(argv)
    zero_to_fp32.convert_zero_checkpoint_to_state_dict(args.checkpoint_dir, args.output_dir, args.dtype,
                                                       args.max_shard_size, args.safe_serialization, args.tag,
                                                       args.exclude_frozen_parameters)


if __name__ == "__main__":
    main()
