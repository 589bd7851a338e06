"""bench/path_to_criu.py's own logic without CRIU: a row's median and 90th percentile over the restores that have
both marks, and the import profile read from `-X importtime` up to the restore's module (the later phases', imported
while CRIU runs, are not on the path)."""

from __future__ import annotations

from bench.path_to_criu import cell, import_profile

IMPORTTIME = """import time: self [us] | cumulative | imported package
import time:       500 |        500 |   typing
import time:      2000 |       2500 | coldsnap_probe
import time:      1000 |       1000 |     dataclasses
import time:      3000 |       4000 | coldsnap_probe._restore
import time:      9000 |       9000 | coldsnap_probe._restore_after_criu
coldsnap-worker: restore phase validate
"""


def test_a_rows_cells_are_median_and_p90_of_the_restores_that_have_both_marks() -> None:
    samples = [{"a": 0.0, "b": float(ms) * 1e6} for ms in range(1, 11)] + [{"a": 0.0}]
    assert cell(samples, "a", "b") == "5.5 (9.0)"  # milliseconds; the restore without `b` is left out
    assert cell([{"kdat_probe": 0.05}], "kdat_probe", "") == "50.0 (50.0)"  # a duration the report states, in s
    assert cell([{"a": 0.0}], "kdat_probe", "") == "-"  # none ran


def test_the_import_profile_ends_at_the_restores_module_and_sums_self_times() -> None:
    profile = import_profile(IMPORTTIME, top=2)
    assert profile.startswith("4 modules, 6.5 ms in all (self); the 2 largest, ms:")
    assert "coldsnap_probe._restore " in profile and "_restore_after_criu" not in profile
    assert "typing" not in profile  # the two largest only: _restore (4.0) and coldsnap_probe (2.5)
