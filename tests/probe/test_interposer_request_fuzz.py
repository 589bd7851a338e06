"""Issue 37 item 8: the interposer's control-socket request parser (hydration/interposer/request.c) under a
deterministic mutation fuzzer (tests/probe/fuzz_interposer_request.c), compiled by gcc with AddressSanitizer and
UndefinedBehaviorSanitizer, every report fatal. The review fed it 3 million mutated requests by hand; this runs
4 million on every test run (two seeds, one per core, a few seconds each) and requires no sanitizer report, the
parser's contract on every input (see the harness) and every refusal rule reached. A second test plants an
off-by-one in a copy of the parser and requires the same run to find it: the check can fail."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from coldsnap_probe.hydration._interposer import SOURCES

HARNESS = Path(__file__).resolve().parent / "fuzz_interposer_request.c"
SEEDS = (1, 2)  # one process per core
INPUTS = 2_000_000  # per seed
FLAGS = ("-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fno-omit-frame-pointer",
         "-fsanitize=address,undefined", "-fno-sanitize-recover=all")
# Leaks are no concern of a parser that allocates nothing, and LeakSanitizer needs ptrace, which CI may not allow.
SANITIZERS = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}


def build(folder: Path, parser: Path) -> Path:
    """The harness linked with `parser` (request.c or a copy), instrumented."""
    binary = folder / "fuzz_interposer_request"
    subprocess.run(["gcc", *FLAGS, "-I", str(SOURCES), "-o", str(binary), str(HARNESS), str(parser)], check=True,
                   capture_output=True, text=True)
    return binary


def fuzz(binary: Path, inputs: int, seeds: tuple[int, ...]) -> list[subprocess.CompletedProcess[str]]:
    """One run per seed, at once; each one's outcome."""
    runs = [subprocess.Popen([str(binary), str(inputs), str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, **SANITIZERS}) for seed in seeds]
    done = []
    for run in runs:
        out, err = run.communicate(timeout=240)
        done.append(subprocess.CompletedProcess(run.args, run.returncode, out, err))
    return done


@pytest.mark.timeout(300)
def test_the_request_parser_takes_millions_of_mutated_requests_without_a_sanitizer_report(tmp_path: Path) -> None:
    for run in fuzz(build(tmp_path, SOURCES / "request.c"), INPUTS, SEEDS):
        assert run.returncode == 0, run.stderr[-6000:]
        assert "runtime error" not in run.stderr and "Sanitizer" not in run.stderr, run.stderr[-6000:]
        report = json.loads(run.stdout.splitlines()[-1])
        assert report["inputs"] == INPUTS and report["accepted"] + report["refused"] == INPUTS
        assert report["accepted"] > INPUTS // 100, report  # the mutations keep many requests valid, too
        assert all(count > 0 for count in report["rules"].values()), report  # every refusal rule is reached


@pytest.mark.timeout(120)
def test_the_fuzzer_finds_an_off_by_one_planted_in_the_parser(tmp_path: Path) -> None:
    source = (SOURCES / "request.c").read_text()
    bound = "if (n + 1 >= room) {"  # a string's copy keeps a byte for its NUL
    assert source.count(bound) == 1, "request.c changed: plant the off-by-one elsewhere"
    planted = tmp_path / "request.c"
    planted.write_text(source.replace(bound, "if (n >= room) {"))
    (run,) = fuzz(build(tmp_path, planted), 200_000, (1,))
    assert run.returncode != 0 and "AddressSanitizer: stack-buffer-overflow" in run.stderr, run.stderr[-3000:]
