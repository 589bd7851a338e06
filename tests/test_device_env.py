"""scripts/_device_env.sh, the prelude every step of scripts/device sources: the carried wheels are installed once
per set into a site directory that persists between runs on a warm machine. Real wheels, a real pip, a real
bash; the site directory is the test's own (COLDSNAP_DEVICE_SITE)."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.helpers import ROOT


def wheel(directory: Path, name: str, value: str) -> Path:
    """A minimal valid wheel of module `name` whose VALUE is `value` (fixed timestamps: the same bytes each time
    but for `value`)."""
    files = {f"{name}/__init__.py": f"VALUE = {value!r}\n",
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                           "Tag: py3-none-any\n"}
    record = "".join(f"{path},sha256={_digest(text)},{len(text.encode())}\n" for path, text in files.items())
    files[f"{name}-1.0.dist-info/RECORD"] = record + f"{name}-1.0.dist-info/RECORD,,\n"
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for inside, text in files.items():
            archive.writestr(zipfile.ZipInfo(inside, (2026, 1, 1, 0, 0, 0)), text)
    os.utime(path, (1_700_000_000, 1_700_000_000))  # one mtime for every set: as a copy onto the machine may give
    return path


def _digest(text: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).decode().rstrip("=")


def imported(work: Path, site: Path, code: str) -> str:
    """What `code` prints in a python3 started after sourcing the prelude in `work` (its .whl carried)."""
    env = {**os.environ, "COLDSNAP_DEVICE_SITE": str(site), "OUT": str(work / "out")}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", "-c", f'source "{ROOT}/scripts/_device_env.sh" && "{sys.executable}" -c "$0"',
                           code], cwd=work, env=env, capture_output=True, text=True, timeout=120, check=False)
    return done.stdout.strip() or done.stderr.strip()[-300:]


def test_another_set_of_wheels_of_the_same_names_sizes_and_times_is_installed(tmp_path: Path) -> None:
    """Regression (review4): a set was named by `ls -l` (names, sizes, minutes), so a rebuilt wheel of the same
    name and size copied within the same minute was taken for the installed one, and the old code ran."""
    (tmp_path / ".whl").mkdir()
    site = tmp_path / "site"
    wheel(tmp_path / ".whl", "csreview", "1")
    assert imported(tmp_path, site, "import csreview; print(csreview.VALUE)") == "1"
    wheel(tmp_path / ".whl", "csreview", "2")  # the same name, size and mtime; other bytes
    assert imported(tmp_path, site, "import csreview; print(csreview.VALUE)") == "2"


def test_a_package_of_an_earlier_set_is_not_importable_after_another_set(tmp_path: Path) -> None:
    """Regression (review4): `pip install --upgrade --target` replaces the new set's packages and leaves the
    others, so a package the new set no longer has was still imported from the earlier set."""
    (tmp_path / ".whl").mkdir()
    site = tmp_path / "site"
    wheel(tmp_path / ".whl", "csreview", "1")
    stale = wheel(tmp_path / ".whl", "csstale", "1")
    assert imported(tmp_path, site, "import csstale; print(csstale.VALUE)") == "1"
    stale.unlink()
    assert "No module named 'csstale'" in imported(tmp_path, site, "import csstale")
    assert imported(tmp_path, site, "import csreview; print(csreview.VALUE)") == "1"
