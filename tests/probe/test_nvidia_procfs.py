"""The kernel module's procfs (`_nvidia_procfs.py`): the real formats, the device selection rule, safe reads.

The files are written with the kernel module's own format strings (`nv-procfs.c`, NVIDIA/open-gpu-kernel-modules:
`nv_procfs_read_version`, `nv_procfs_read_gpu_info`, the NVRM id of `utils.mk`'s GENERATE_NVIDSTRING); on the GPU
host, tests/probe/test_host.py compares the real procfs with NVML.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coldsnap_probe._nvidia_procfs import MAX_FILE_BYTES, KernelGpu, kernel_gpu

PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Release Build  "
               "(dvs-builder@U22-I3-AF03-09-1)  Sun Sep 14 01:09:24 UTC 2025\n"
               "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04) \n")
OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  595.45.04  Release Build  "
        "(dvs-builder@U22-I3-AF03-09-1)  Tue Nov  4 18:04:58 UTC 2025\n"
        "GCC version:  gcc version 13.2.0 (GCC) \n")
H200_UUID = "GPU-2b1e0c7a-5f3d-8e41-9a6c-0d2f4b7e8c15"
OTHER_UUID = "GPU-7f00aa11-2233-4455-6677-8899aabbccdd"


def information(model: str, uuid: str | None, bus: str, excluded: str = "No") -> str:
    """`nv_procfs_read_gpu_info`'s output, line for line (its seq_printf formats, e.g. "Model: \\t\\t %s\\n")."""
    text = f"Model: \t\t {model}\nIRQ:   \t\t 0\n"
    if uuid is not None:  # printed only when the RM returned one
        text += f"GPU UUID: \t {uuid}\n"
    return text + ("Video BIOS: \t 96.00.af.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
                   f"DMA Mask: \t 0x{0xfffffffffffff:x}\nBus Location: \t {bus}\nDevice Minor: \t 0\n"
                   f"GPU Firmware: \t 580.159.04\nGPU Excluded:\t {excluded}\n")


def tree(root: Path, version: str = PROPRIETARY, gpus: dict[str, str] | None = None) -> Path:
    """A /proc/driver/nvidia: `version` and gpus/<bus id>/information."""
    (root / "gpus").mkdir(parents=True)
    (root / "version").write_text(version)
    for bus, info in (gpus if gpus is not None else {"0000:1b:00.0": information("NVIDIA H200", H200_UUID,
                                                                                 "0000:1b:00.0")}).items():
        (root / "gpus" / bus).mkdir()
        (root / "gpus" / bus / "information").write_text(info)
    return root


def two_gpus(root: Path) -> Path:
    return tree(root, gpus={"0000:1b:00.0": information("NVIDIA H200", H200_UUID, "0000:1b:00.0"),
                            "0000:43:00.0": information("NVIDIA H100 80GB HBM3", OTHER_UUID, "0000:43:00.0")})


def test_kernel_gpu_reads_a_lone_gpu_by_index_zero_as_nvml_writes_it(tmp_path: Path) -> None:
    assert kernel_gpu("0", tree(tmp_path)) == KernelGpu(driver_version="580.159.04", gpu_uuid=H200_UUID,
                                                        gpu_name="NVIDIA H200")


def test_kernel_gpu_reads_the_open_kernel_modules_version_line(tmp_path: Path) -> None:
    found = kernel_gpu("0", tree(tmp_path, OPEN))
    assert isinstance(found, KernelGpu) and found.driver_version == "595.45.04"


def test_kernel_gpu_finds_a_uuid_among_several_gpus(tmp_path: Path) -> None:
    assert kernel_gpu(OTHER_UUID, two_gpus(tmp_path)) == KernelGpu(
        driver_version="580.159.04", gpu_uuid=OTHER_UUID, gpu_name="NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize(("selector", "reason"), [
    ("0", "device index 0 with 2 GPU(s)"),  # NVML's index order is not procfs's promise
    ("1", "device index 1 with 2 GPU(s)"),
    ("GPU-00000000-0000-0000-0000-000000000000", "0 GPU(s)"),
    ("GPU-" + H200_UUID[4:].upper(), "neither an index nor a GPU UUID"),  # NVML writes lower-case hex
    ("MIG-2b1e0c7a-5f3d-8e41-9a6c-0d2f4b7e8c15", "a MIG device is not listed in procfs"),
    ("-1", "neither an index nor a GPU UUID"),
    ("0" * 5000, "neither an index nor a GPU UUID"),  # int() would refuse it (over 4300 digits)
    ("\u0660", "neither an index nor a GPU UUID"),  # a decimal digit, not an ASCII one
    ("", "neither an index nor a GPU UUID"),
])
def test_kernel_gpu_leaves_an_uncertain_selection_to_nvml(tmp_path: Path, selector: str, reason: str) -> None:
    found = kernel_gpu(selector, two_gpus(tmp_path))
    assert isinstance(found, str) and reason in found


def test_kernel_gpu_index_one_of_a_lone_gpu_is_not_answered(tmp_path: Path) -> None:
    assert "device index 1 with 1 GPU(s)" in str(kernel_gpu("1", tree(tmp_path)))


@pytest.mark.parametrize(("info", "reason"), [
    (information("Unknown", H200_UUID, "0000:1b:00.0"), "model 'Unknown'"),  # rm_get_device_name's fallback
    (information("NVIDIA H200", None, "0000:1b:00.0"), "uuid ''"),
    (information("NVIDIA H200", H200_UUID, "0000:1b:00.0", excluded="Yes"), "does not state a usable"),
    (information("NVIDIA H200", H200_UUID, "0000:1b:00.0") + "Model: \t\t NVIDIA H100\n", "appears twice"),
    ("Model: \t\t NVIDIA H200 \u00e9\nGPU UUID: \t " + H200_UUID + "\n", "codec can't decode"),
])
def test_kernel_gpu_refuses_information_it_cannot_vouch_for(tmp_path: Path, info: str, reason: str) -> None:
    found = kernel_gpu("0", tree(tmp_path, gpus={"0000:1b:00.0": info}))
    assert isinstance(found, str) and reason in found


@pytest.mark.parametrize("version", [
    "", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  Release Build\n",
    "NVRM version: something else 580.159.04 \n", "GCC version:  gcc 12\n"])
def test_kernel_gpu_needs_the_driver_version_line(tmp_path: Path, version: str) -> None:
    assert "does not state the driver version" in str(kernel_gpu("0", tree(tmp_path, version)))


def test_kernel_gpu_without_the_kernel_module_names_the_missing_directory(tmp_path: Path) -> None:
    assert kernel_gpu("0", tmp_path / "absent") == f"{tmp_path / 'absent'}: No such file or directory"


def test_kernel_gpu_ignores_entries_that_are_not_bus_ids(tmp_path: Path) -> None:
    root = tree(tmp_path)
    (root / "gpus" / "README").write_text("not a GPU")
    assert isinstance(kernel_gpu("0", root), KernelGpu)


@pytest.mark.parametrize("link", ["gpus", "gpus/0000:1b:00.0", "gpus/0000:1b:00.0/information", "version"])
def test_kernel_gpu_never_follows_a_symbolic_link(tmp_path: Path, link: str) -> None:
    root = tree(tmp_path / "proc")
    real = tmp_path / "elsewhere"
    (root / link).rename(real)
    (root / link).symlink_to(real)
    found = kernel_gpu("0", root)
    assert isinstance(found, str) and ("Too many levels of symbolic links" in found or "Not a directory" in found)


def test_kernel_gpu_does_not_block_on_a_fifo(tmp_path: Path) -> None:
    root = tree(tmp_path)
    (root / "version").unlink()
    os.mkfifo(root / "version")  # an open without O_NONBLOCK would wait for a writer forever
    assert "version is not a regular file" in str(kernel_gpu("0", root))


def test_kernel_gpu_reads_at_most_max_file_bytes(tmp_path: Path) -> None:
    root = tree(tmp_path, PROPRIETARY + "x" * MAX_FILE_BYTES)
    assert f"version is larger than {MAX_FILE_BYTES} bytes" in str(kernel_gpu("0", root))
    (root / "version").write_text((PROPRIETARY + "x" * MAX_FILE_BYTES)[:MAX_FILE_BYTES])
    assert isinstance(kernel_gpu("0", root), KernelGpu)  # exactly the limit is read whole
