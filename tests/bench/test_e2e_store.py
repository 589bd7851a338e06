"""bench/e2e_store.py's own logic (the GPU path runs on the H200 through scripts/device store): the restore units of
the store's path do not mount the host's images over the pulled capsule's, the disk's counters see real reads, a
failed phase is named, and each restore is set against the goal."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec
import pytest

from bench import capture_pair, e2e_store
from bench.e2e_restore import IMAGES, RUN
from bench.interposer_units import INTERPOSER_RUN
from bench.serve_units import STAGED, serve_layout
from coldsnap_runtime.store import CaptureData, CaptureStore, artifact_manifest


def test_the_restore_units_keep_every_mount_but_the_host_s_images(tmp_path: Path) -> None:
    layout = serve_layout(tmp_path, tmp_path / "model", STAGED)
    restore = e2e_store.StoreLayout(**{name: getattr(layout, name) for name in layout.__dataclass_fields__})
    targets = [m["target"] for m in restore.mounts()]
    assert IMAGES in [m["target"] for m in layout.mounts()] and IMAGES not in targets
    assert RUN in targets and INTERPOSER_RUN in targets
    assert len(targets) == len(layout.mounts()) - 1


def test_the_disk_counters_see_a_read_that_bypasses_the_page_cache(tmp_path: Path) -> None:
    disk = e2e_store.Disk(tmp_path)
    if not disk.stat.exists():
        pytest.skip(f"{tmp_path} is on no block device with counters ({disk.stat})")
    probe = tmp_path / "probe.bin"
    probe.write_bytes(os.urandom(8 << 20))
    read, _ = disk.counters()
    assert e2e_store.read_parallel(probe, threads=2, chunk=1 << 20, direct=True) > 0
    assert disk.counters()[0] - read >= 8 << 20


def test_a_failed_phase_is_named_and_the_report_says_so(tmp_path: Path) -> None:
    run = e2e_store.Run(e2e_store.Disk(tmp_path))

    async def fails() -> None:
        raise OSError("the registry went away")

    async def steps() -> None:
        await run.phase("ok", anyio.lowlevel.checkpoint)
        await run.phase("image-push", fails)

    with pytest.raises(e2e_store.PhaseFailed, match="phase 'image-push' failed: OSError: the registry went away"):
        anyio.run(steps)
    args = argparse.Namespace(mode=STAGED, store=str(tmp_path / "store"), registry_root="/dev/shm/x")
    text = e2e_store.report(run, [], args)
    assert "| ok " in text and "FAILED: phase 'image-push' failed" in text


def test_each_restore_is_set_against_read_bytes_over_the_best_disk_rate_plus_one_second(tmp_path: Path) -> None:
    run = e2e_store.Run(e2e_store.Disk(tmp_path))
    run.rates = {"disk read, O_DIRECT (1 reader x 8 MiB)": 2.0, "disk read, O_DIRECT (16 readers)": 4.0,
                 "registry link, pull": 9.0}
    restores = [{"first_token_s": 3.4, "disk_read": 10_000_000_000, "create_start_s": 0.2, "identical": True},
                {"first_token_s": 3.6, "disk_read": 10_000_000_000, "create_start_s": 0.2, "identical": True}]
    lines = e2e_store.goal_lines(run, restores)
    assert [line[3] for line in lines] == ["3.50", "3.50"]  # 10 GB / 4 GB/s + 1.0 s
    assert lines[0][4] == "met" and lines[1][4] == "missed by 0.10 s"


def _capture_dir(root: Path, pages: bytes, dump: bytes) -> Path:
    images = root / "images" / root.name
    (images / "device-7").mkdir(parents=True)
    (images / "capture.json").write_text("{}\n")
    (images / "pages-1.img").write_bytes(pages)
    (images / "device-7" / "seg-0.bin").write_bytes(dump)
    region = {"address": 0x7F0000000000, "size": len(dump), "segments": [{"file": "seg-0.bin"}]}
    (images / "device-memory.json").write_text(json.dumps({"processes": [
        {"pid": 7, "directory": "device-7", "manifest": {"regions": [region]}}]}))
    return images


def _stored(store: CaptureStore, images: Path) -> str:
    """The capture as the daemon's build stores it (bench/capsule_transfer.py runs the daemon; this only the store)."""
    files = [store.ingest(f"images/{p.relative_to(images.parent)}", p.stat().st_size, 0o644, p.open("rb"),
                          by_content=p.name.startswith("pages-")) for p in sorted(images.rglob("*"))
             if p.is_file() and p.stat().st_size >= 1 << 20]
    document = msgspec.json.encode(CaptureData(files=files, format=2))
    return store.record(artifact_manifest(document, files), document)


def test_the_second_capture_is_told_by_kind_of_file_beside_64_mib_chunks_and_goes_in_the_report(
        tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "store")
    store.open()
    weights, dump = os.urandom(6 << 20), os.urandom(2 << 20)
    first = _capture_dir(tmp_path / "one", os.urandom(1 << 20) + weights, dump)
    second = _capture_dir(tmp_path / "two", os.urandom((1 << 20) + 8192) + weights, dump)
    captures = (_stored(store, first), _stored(store, second))
    rows = {r["kind"]: r for r in capture_pair.share_rows(capture_pair.fingerprint(first), second.parent,
                                                            tmp_path / "store", captures)}
    pages, dumps = rows["CRIU page images (pages-*.img)"], rows["device dumps (device-<pid>/)"]
    assert pages["bytes"] == (7 << 20) + 8192 and pages["new_fixed_64m"] == pages["bytes"]  # moved: all new
    assert 0 < pages["new_stored"] <= 3 << 20  # cut by content: the new heap and a chunk or two
    assert pages["new_pages"] == (1 << 20) + 8192  # the floor: exactly the new heap's pages
    assert dumps["new_fixed_64m"] == dumps["new_stored"] == 0
    assert rows["small files (the image's layer)"]["files"] == 2  # capture.json, device-memory.json
    run = e2e_store.Run(e2e_store.Disk(tmp_path))
    args = argparse.Namespace(mode=STAGED, store=str(tmp_path / "store"), registry_root="/dev/shm/x")
    result = {"second_capture": {"added": [{"images": 100, "node store": 90, "registry": 95},
                                           {"images": 100, "node store": 4, "registry": 5}],
                                 "by_file": list(rows.values())}}
    text = e2e_store.report(run, [], args, result)
    assert "| capture 2 " in text and "(4.0 %)" in text and "| CRIU page images (pages-*.img) " in text
    assert f"| {second.name}/pages-1.img " in text  # the file with new bytes, named
    assert "seg-0.bin" not in text.split("second capture's file with new bytes")[1]  # the dump: nothing new
    regions = capture_pair.region_rows(list(rows.values()), second.parent)
    assert regions == [{"pid": 7, "address": "0x7f0000000000", "size": 2 << 20, "new": 0}]
    assert capture_pair.region_table(regions)[1] == [["0 of 1 allocations hold new bytes", "", "0.0", "0.0"]]


def test_aslr_off_runs_the_interpreter_asked_for_without_randomisation(tmp_path: Path) -> None:
    layout = serve_layout(tmp_path, tmp_path / "model", STAGED)
    layout.python = sys.executable
    layout.run_dir.mkdir(parents=True)
    assert e2e_store.no_aslr(layout) == f"{RUN}/no-aslr-venv/bin/python3"
    wrapper = layout.run_dir / "no-aslr-venv/bin/python3"
    program = "import sys; print(open('/proc/self/personality').read(), sys.argv[1:])"
    seen = subprocess.run([str(wrapper), "-c", program, "a b"], capture_output=True, text=True,
                          check=True).stdout.split()
    assert int(seen[0], 16) & 0x0040000 and seen[1:] == ["['a", "b']"]
    # What the layout derives from the interpreter's path (the capture worker's site-packages) is the venv's.
    layout.python = str(wrapper)
    assert (layout.run_dir / "no-aslr-venv/lib").resolve() == (Path(sys.executable).parent.parent / "lib").resolve()
