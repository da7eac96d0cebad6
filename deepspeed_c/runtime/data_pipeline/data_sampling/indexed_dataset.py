"""Megatron/DeepSpeed's memory-mapped indexed dataset: `<prefix>.bin` holds the items' elements back to back,
`<prefix>.idx` describes them. The index layout (little-endian), written from the published format:

    9 bytes magic b"MMIDIDX\\x00\\x00", u64 version (1), u8 dtype code, u64 item count N, u64 document count D,
    i32 sizes[N] (elements per item), i64 pointers[N] (byte offset of each item in .bin), i64 doc_idx[D]

dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 uint16, 7 uint32, 8 uint64 (DeepSpeed's table).
Files written here are read by DeepSpeed's MMapIndexedDataset and the other way round."""
from __future__ import annotations

import os
import struct
from typing import Any, Union

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
DTYPES: dict[int, Any] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint16,
                          7: np.uint32, 8: np.uint64}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def dtype_code(dtype: Any) -> int:
    try:
        return _CODES[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(f"MMapIndexedDataset: unsupported element dtype {dtype!r}; expected one of "
                         f"{', '.join(str(np.dtype(d)) for d in DTYPES.values())}") from None


class MMapIndexedDataset:
    """Reads `<path>.idx` / `<path>.bin`: dataset[i] is item i (a numpy view), dataset[a:b] a list of them."""

    def __init__(self, path: str, skip_warmup: bool = True) -> None:
        idx_path, bin_path = index_file_path(path), data_file_path(path)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"MMapIndexedDataset: {p} does not exist (an index file pair is "
                                        f"<prefix>.idx and <prefix>.bin; prefix given: {path!r})")
        with open(idx_path, "rb") as f:
            head = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if len(head) < 34 or head[:9] != MAGIC:
            raise ValueError(f"MMapIndexedDataset: {idx_path} is not a memory-mapped index file (bad magic "
                             f"{head[:9]!r}, expected {MAGIC!r})")
        version, code, count, docs = struct.unpack("<QBQQ", head[9:])
        if version != 1 or code not in DTYPES:
            raise ValueError(f"MMapIndexedDataset: {idx_path} has version {version} / dtype code {code}; "
                             f"expected version 1 and a code in {sorted(DTYPES)}")
        self.path = path
        self.dtype = np.dtype(DTYPES[code])
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = 34
        self._sizes = np.frombuffer(idx, dtype=np.int32, count=count, offset=off)
        self._pointers = np.frombuffer(idx, dtype=np.int64, count=count, offset=off + 4 * count)
        self._doc_idx = np.frombuffer(idx, dtype=np.int64, count=docs, offset=off + 12 * count)
        self._idx = idx
        nbytes = os.path.getsize(bin_path)
        if count and int(self._pointers[-1]) + int(self._sizes[-1]) * self.dtype.itemsize > nbytes:
            raise ValueError(f"MMapIndexedDataset: {bin_path} is {nbytes} bytes, shorter than {idx_path} describes "
                             "(the pair does not match)")
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if nbytes else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        """Byte offset of each item in the .bin file."""
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    def _item(self, i: int) -> np.ndarray:
        return np.frombuffer(self._bin, dtype=self.dtype, count=int(self._sizes[i]), offset=int(self._pointers[i]))

    def __getitem__(self, idx: Union[int, slice]) -> Any:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("MMapIndexedDataset: slices must be contiguous (step 1)")
            return [self._item(i) for i in range(start, stop)]
        i = int(idx)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"MMapIndexedDataset {self.path}: item {idx} out of range (0..{len(self) - 1})")
        return self._item(i)


class MMapIndexedDatasetBuilder:
    """Writes `<prefix>.bin` item by item; `finalize(<prefix>.idx)` writes the index."""

    def __init__(self, out_file: str, dtype: Any = np.int64) -> None:
        dtype_code(dtype)
        self._dtype = np.dtype(dtype)
        self._data_file = open(out_file, "wb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item_numpy(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=self._dtype)
        self._data_file.write(array.tobytes(order="C"))
        self._sizes.append(array.size)

    def add_item(self, tensor: Any) -> None:
        self.add_item_numpy(np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor))

    def add_scalar_items_numpy(self, array: np.ndarray) -> None:
        """Each element of `array` as an item of its own (one write for all of them)."""
        array = np.ascontiguousarray(array, dtype=self._dtype).reshape(-1)
        self._data_file.write(array.tobytes(order="C"))
        self._sizes.extend([1] * array.size)

    def add_items(self, arrays: list) -> None:
        for a in arrays:
            self.add_item_numpy(a)

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def finalize(self, index_file: str) -> None:
        self._data_file.close()
        sizes = np.asarray(self._sizes, dtype=np.int64)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            pointers[1:] = np.cumsum(sizes[:-1] * self._dtype.itemsize)
        with open(index_file, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", 1, dtype_code(self._dtype), len(sizes), len(self._doc_idx)))
            f.write(sizes.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self._doc_idx, dtype=np.int64).tobytes(order="C"))
