#!/usr/bin/env python
"""Convert a ZeRO checkpoint into plain PyTorch weights of a chosen dtype:

    python zero_to_torch.py <checkpoint_dir> <output_dir> --dtype bf16 [--safe_serialization] [--tag TAG]

Copied beside zero_to_fp32.py into every checkpoint directory (DeepSpeed's layout), so it runs from
there with no package installed; it uses that zero_to_fp32.py."""
from __future__ import annotations

import argparse

if __package__:
    from . import zero_to_fp32
else:  # run as a copied script: its sibling is importable from the script's own directory
    import zero_to_fp32  # type: ignore[no-redef]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="directory holding the 'latest' file and tag folders")
    parser.add_argument("output_dir", help="directory for the converted weights")
    parser.add_argument("--dtype", required=True, choices=sorted(zero_to_fp32.OUTPUT_DTYPE_NAMES),
                        help="dtype of the floating-point tensors written")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    zero_to_fp32.convert_zero_checkpoint_to_state_dict(args.checkpoint_dir, args.output_dir, args.dtype,
                                                       args.max_shard_size, args.safe_serialization, args.tag,
                                                       args.exclude_frozen_parameters)


if __name__ == "__main__":
    main()
