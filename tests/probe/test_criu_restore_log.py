"""`_criu_restore_log.restore_phases`: CRIU's restore log read into phases (a real log is read in
test_criu_restore.py's restore test, through the worker's report); here the log's shapes: one task, a tree of two,
a stock one-stream restore without fill lines, a cut log."""

from __future__ import annotations

import pytest

from coldsnap_probe._criu_restore_log import restore_phases

ONE_TASK = b"""(00.000000) CRIU run id = x
(00.000121) Loaded kdat cache from /tmp/coldsnap-kdat-1/criu.kdat
(00.002100) Reading image tree
(00.002394) Forking task with 17041 pid (flags 0x0)
(00.424133)  17041: page-fill: pages-2.img: 1201602560 bytes in 36 chunks by 2 threads in 0.407 s (2.95 GB/s)
(00.424793)  17041: Restoring resources
(00.436930) pie: 17041: Switched to the restorer 17041
(00.457275) net: Unlock network
(00.492942) Restore finished successfully. Tasks resumed.
(00.493082) Running post-resume scripts
"""


def test_one_task_log_gives_every_phase() -> None:
    assert restore_phases(ONE_TASK) == pytest.approx({
        "probe_setup_s": 0.0021, "images_fork_s": 0.000294, "premap_s": 0.424133 - 0.407 - 0.002394,
        "fill_s": 0.407, "files_state_s": 0.436930 - 0.424133, "restorer_s": 0.457275 - 0.436930,
        "seize_stop_s": 0.492942 - 0.457275, "logged_s": 0.493082})


def test_a_tree_of_two_counts_the_last_fill_and_the_last_restorer() -> None:
    tree = ONE_TASK.replace(b"(00.436930) pie: 17041", b"(00.436930) pie: 17041: x\n(00.440000) pie: 17050").replace(
        b"(00.424133)  17041", b"(00.300000)  17050: page-fill: pages-3.img: 1 bytes in 1 chunks by 2 threads in "
                               b"0.100 s (1 GB/s)\n(00.424133)  17041")
    phases = restore_phases(tree)
    assert phases["fill_s"] == pytest.approx(0.407)  # the slowest task's, ending last
    assert phases["files_state_s"] == pytest.approx(0.44 - 0.424133)  # to the last task in its restorer
    assert phases["restorer_s"] == pytest.approx(0.457275 - 0.44)


def test_a_stock_restore_without_fill_lines_leaves_out_what_it_cannot_tell() -> None:
    stock = b"\n".join(line for line in ONE_TASK.split(b"\n") if b"page-fill" not in line)
    phases = restore_phases(stock)
    assert set(phases) == {"probe_setup_s", "images_fork_s", "restorer_s", "seize_stop_s", "logged_s"}


def test_a_log_cut_short_gives_only_its_phases() -> None:
    cut = ONE_TASK[:ONE_TASK.index(b"(00.436930)")]
    assert set(restore_phases(cut)) == {"probe_setup_s", "images_fork_s", "premap_s", "fill_s", "logged_s"}
    assert restore_phases(b"") == {}
