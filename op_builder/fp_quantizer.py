import hashlib
import importlib
from pathlib import Path
from types import ModuleType

from .builder import OpBuilder, cache_root


class FPQuantizerBuilder(OpBuilder):
    """DeepSpeed's `fp_quantizer` op (FP4/6/8/12 group quantization of frozen weights). deepspeed_c's is
    plain torch (deepspeed_c/ops/fp_quantizer), so it compiles nothing: always compatible, always built,
    and load() imports the Python module."""

    NAME = "fp_quantizer"
    _MODULE = "deepspeed_c.ops.fp_quantizer"

    def sources(self) -> list[str]:
        return []

    def incompatible_reason(self) -> str | None:
        return None

    def _source_files(self) -> list[Path]:
        # locating the package without importing it keeps the env report free of torch imports
        here = Path(__file__).resolve().parent.parent
        pkg = here / "deepspeed_c" / "ops" / "fp_quantizer"
        if not pkg.is_dir():  # installed layout: op_builder lives inside deepspeed_c/ops
            pkg = here / "fp_quantizer"
        return sorted(pkg.glob("*.py"))

    def build_key(self) -> str:
        h = hashlib.sha256(self.NAME.encode())
        for path in self._source_files():
            h.update(path.name.encode())
            h.update(path.read_bytes())
        return h.hexdigest()[:20]

    def built_path(self) -> Path:
        return cache_root() / self.NAME / "python-only"  # nothing is written there: the report shows the cache

    def is_built(self) -> bool:
        return True

    def build_into(self, out_dir: Path, objects_dir: Path | None = None) -> Path:
        return out_dir  # nothing to compile ahead of time

    def load(self, verbose: bool = False) -> ModuleType:
        return importlib.import_module(self._MODULE)

    @staticmethod
    def get_default_quant_dtype():
        import torch

        return torch.uint8

    @staticmethod
    def get_quant_range(q_bits: int | None = None) -> float:
        """The largest code value of a q_bits code (8: E4M3, 6: E3M2, 12: E7M4, 4: E2M1)."""
        from deepspeed_c.ops.fp_quantizer import minifloat

        exp_bits, man_bits = minifloat.code_format(q_bits, 3)
        return float(minifloat.magnitude_table(exp_bits, man_bits)[-1])
