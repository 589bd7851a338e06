"""The interposer's configuration and the release's own threads, without a GPU: the copy engine's defaults
reach the control socket as configured (a 4 MiB staging buffer, not 4 bytes: a release of 1 GiB then never
ended on the H200), and the threads a release runs on never wait at the gate that release closed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from coldsnap_probe.jsonline import request
from tests.probe.interposer_harness import UNITY
from tests.probe.test_interposer import library, listening

__all__ = ("library",)  # the module fixture, shared
MIB = 1 << 20


@pytest.mark.parametrize(("setting", "staging"), [
    (None, 4 * MIB), ("8", 8 * MIB), ("0", 4 * MIB), ("many", 4 * MIB), ("4096", 64 * MIB),
    ("17592186044416", 64 * MIB), ("-1", 4 * MIB)])  # 2**44 MiB wrapped to 0 bytes; strtoull took -1 as its max
def test_the_staging_buffer_is_the_configured_mebibytes(library: Path, setting: str | None, staging: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if setting is None:
        monkeypatch.delenv("COLDSNAP_CUDA_INTERPOSER_STAGING_MIB", raising=False)
    else:
        monkeypatch.setenv("COLDSNAP_CUDA_INTERPOSER_STAGING_MIB", setting)
    monkeypatch.delenv("COLDSNAP_CUDA_INTERPOSER_THREADS", raising=False)
    with listening(library) as (_proc, path):
        status = request(path, {"op": "status"})
    assert status["staging_bytes"] == staging  # at most one digest chunk (64 MiB)
    assert 4 <= status["threads"] <= 16 and status["threshold"] == 2 * MIB and status["unwrapped"] == []
    assert status["drain_s"] == 10


@pytest.mark.parametrize(("mib", "kib", "dump_staging"), [
    (None, None, 4 * MIB), ("8", None, 8 * MIB), (None, "256", 256 << 10), ("2", "100", 100 << 10),
    (None, "3", 64 << 10), (None, "1000000", 64 * MIB), (None, "130", 128 << 10),
    (None, "18014398509481985", 64 * MIB)])  # 2**54 + 1 KiB: the product wrapped to 1 KiB, then the floor
def test_a_releases_staging_is_its_own_knob_in_kib(library: Path, mib: str | None, kib: str | None,
                                                   dump_staging: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """COLDSNAP_CUDA_INTERPOSER_DUMP_STAGING_KIB sizes only a release's buffers (the fill keeps STAGING_MIB's):
    64 KiB to one digest chunk, whole 4 KiB pages; unset, the release takes STAGING_MIB's size."""
    for name, value in (("COLDSNAP_CUDA_INTERPOSER_STAGING_MIB", mib),
                        ("COLDSNAP_CUDA_INTERPOSER_DUMP_STAGING_KIB", kib)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with listening(library) as (_proc, path):
        status = request(path, {"op": "status"})
    assert status["dump_staging_bytes"] == dump_staging
    assert status["staging_bytes"] == (int(mib) if mib else 4) * MIB


@pytest.mark.parametrize(("shrink", "stack_bytes", "expected", "complaint"), [
    (None, None, (True, 16), ""), ("0", "4096", (False, 4096), ""), ("1", "256", (True, 256), ""),
    ("no", "0", (True, 16), "COLDSNAP_CUDA_INTERPOSER_SHRINK_STACK=no must be 0 or 1, using 1"),
    ("", "1k", (True, 16), "COLDSNAP_CUDA_INTERPOSER_STACK_BYTES=1k is not a positive integer, using 16")])
def test_the_stack_limit_knobs_reach_the_control_socket(library: Path, shrink: str | None, stack_bytes: str | None,
                                                        expected: tuple[bool, int], complaint: str,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    """On by default at 16 bytes (the driver's floor that it reads back: bench/checkpoint_anatomy.py --set limits);
    `0` turns it off; a mistyped value is named on the engine's stderr with its rule
    and the default is kept (a capture never changes behaviour because of a typo)."""
    for name, value in (("COLDSNAP_CUDA_INTERPOSER_SHRINK_STACK", shrink),
                        ("COLDSNAP_CUDA_INTERPOSER_STACK_BYTES", stack_bytes)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with listening(library) as (_proc, path):  # its stderr is this test's (inherited), read by capfd
        status = request(path, {"op": "status"})
    assert (status["shrink_stack"], status["stack_bytes"], status["stack_lowered"]) == (*expected, 0)
    stderr = capfd.readouterr().err
    assert complaint in stderr and (complaint or "STACK" not in stderr), stderr


EXEMPT_HARNESS = UNITY + r"""

static volatile int passed[2];

/* A gated call from a thread: exempt (a copy thread of the release) or not (an engine thread). */
static void *call(void *exempt)
{
    if (exempt)
        cscu_gate_exempt();
    cscu_gate_enter();
    cscu_gate_enter();  /* nested, as a driver reaching another gated name */
    cscu_gate_leave();
    cscu_gate_leave();
    passed[exempt ? 1 : 0] = 1;
    return NULL;
}

int main(void)
{
    pthread_t engine, copier;
    cscu_gate_close();  /* the release */
    pthread_create(&engine, NULL, call, NULL);
    pthread_create(&copier, NULL, call, (void *)1);
    pthread_join(copier, NULL);  /* returns: the release's own calls pass the closed gate */
    usleep(100000);
    int engine_waited = !passed[0];
    cscu_gate_exempt();  /* the control thread: its own calls pass too, and count nothing */
    cscu_gate_enter();
    cscu_gate_leave();
    cscu_gate_open();  /* the hydration */
    pthread_join(engine, NULL);
    printf("%d %d %d %ld\n", passed[1], engine_waited, passed[0], __atomic_load_n(&gate_inside, __ATOMIC_SEQ_CST));
    return 0;
}
"""


def test_the_releases_own_threads_pass_the_gate_it_closed(tmp_path: Path) -> None:
    """Compiled with the sources and a harness (no driver): a copy thread's gated call, nested or not, passes the
    closed gate; an engine thread's waits until the gate opens; nothing stays counted in."""
    from coldsnap_probe.hydration._interposer import SOURCES

    (tmp_path / "exempt.c").write_text(EXEMPT_HARNESS)
    subprocess.run(["gcc", "-O2", "-std=gnu11", "-I", str(SOURCES), "-o", str(tmp_path / "exempt"),
                    str(tmp_path / "exempt.c"), "-ldl", "-lpthread"], check=True, capture_output=True)
    done = subprocess.run([str(tmp_path / "exempt")], capture_output=True, text=True, check=True, timeout=30,
                          env={**os.environ, "COLDSNAP_CUDA_INTERPOSER_SOCKET": str(tmp_path / "unused.sock")})
    copier_passed, engine_waited, engine_passed, inside = map(int, done.stdout.split())
    assert copier_passed == 1 and engine_waited == 1 and engine_passed == 1 and inside == 0


DRAIN_HARNESS = UNITY + r"""

static volatile int later_passed;

static void *stuck(void *unused)  /* an engine call inside the driver for 3 s (a synchronise on long work) */
{
    (void)unused;
    cscu_gate_enter();
    sleep(3);
    cscu_gate_leave();
    return NULL;
}

static void *later(void *unused)  /* an engine call made after the release gave up */
{
    (void)unused;
    cscu_gate_enter();
    later_passed = 1;
    cscu_gate_leave();
    return NULL;
}

int main(void)
{
    pthread_t a, b;
    struct timespec t0, t1;
    pthread_create(&a, NULL, stuck, NULL);
    usleep(100000);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long inside = cscu_gate_close();  /* gives up after the drain time (1 s), the gate open again */
    clock_gettime(CLOCK_MONOTONIC, &t1);
    pthread_create(&b, NULL, later, NULL);
    pthread_join(b, NULL);
    pthread_join(a, NULL);
    long after = cscu_gate_close();  /* nothing inside now: closes at once */
    int waited_ms = (int)((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000);
    printf("%ld %d %d %ld %d\n", inside, waited_ms, later_passed, after, cscu_gate_is_open());
    return 0;
}
"""


def test_a_release_that_cannot_drain_the_engines_calls_gives_up_and_reopens_the_gate(tmp_path: Path) -> None:
    """A call that stays inside longer than COLDSNAP_CUDA_INTERPOSER_DRAIN_S: the close gives up (naming one call
    inside) after about that long and leaves the gate open, so the engine is never frozen by a refused release;
    once the call has left, a close succeeds."""
    from coldsnap_probe.hydration._interposer import SOURCES

    (tmp_path / "drain.c").write_text(DRAIN_HARNESS)
    subprocess.run(["gcc", "-O2", "-std=gnu11", "-I", str(SOURCES), "-o", str(tmp_path / "drain"),
                    str(tmp_path / "drain.c"), "-ldl", "-lpthread"], check=True, capture_output=True)
    done = subprocess.run([str(tmp_path / "drain")], capture_output=True, text=True, check=True, timeout=30,
                          env={**os.environ, "COLDSNAP_CUDA_INTERPOSER_SOCKET": str(tmp_path / "unused.sock"),
                               "COLDSNAP_CUDA_INTERPOSER_DRAIN_S": "1"})
    inside, waited_ms, later_passed, after, open_now = map(int, done.stdout.split())
    assert inside == 1 and 900 <= waited_ms < 2900 and later_passed == 1  # gave up before the call ended (3 s)
    assert after == 0 and open_now == 0
