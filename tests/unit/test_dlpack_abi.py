"""Our hand-written DLPack declarations agree, member by member, with the header torch ships."""
import pathlib
import subprocess
import sysconfig

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCH_DLPACK = pathlib.Path(torch.__file__).parent / "include" / "ATen" / "dlpack.h"

MEMBERS = {
    "DLTensor": ["data", "device", "ndim", "dtype", "shape", "strides", "byte_offset"],
    "DLManagedTensor": ["dl_tensor", "manager_ctx", "deleter"],
    "DLManagedTensorVersioned": ["version", "manager_ctx", "deleter", "flags", "dl_tensor"],
    "DLPackExchangeAPI": ["header", "managed_tensor_allocator", "managed_tensor_from_py_object_no_sync",
                          "managed_tensor_to_py_object_no_sync", "dltensor_from_py_object_no_sync",
                          "current_work_stream"],
}


def layout_program(header: str, prefix: str = "") -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", f'#include "{header}"', "int main(void) {"]
    for struct, members in MEMBERS.items():
        lines.append(f'printf("{struct} %zu\\n", sizeof({struct}));')
        for m in members:
            lines.append(f'printf("{struct}.{m} %zu\\n", offsetof({struct}, {m}));')
    lines.append("return 0; }")
    return "\n".join(lines)


def run_layout(tmp_path, header: str, includes: list[str]) -> str:
    src = tmp_path / f"layout_{abs(hash(header))}.c"
    exe = tmp_path / (src.stem + ".bin")
    src.write_text(layout_program(header))
    subprocess.run(["cc", "-std=c11", *[f"-I{i}" for i in includes], str(src), "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], check=True, stdout=subprocess.PIPE, text=True).stdout


@pytest.mark.skipif(not TORCH_DLPACK.exists(), reason="this torch ships no ATen/dlpack.h to compare against")
def test_layout_matches_torch_header(tmp_path):
    ours = run_layout(tmp_path, "dsc/dlpack_abi.h", [str(ROOT / "csrc" / "include")])
    theirs = run_layout(tmp_path, str(TORCH_DLPACK), [])
    assert ours == theirs
    assert "DLPackExchangeAPI.current_work_stream" in ours
