"""The Dockerfile scanner behind `build_remote_sources` (issue 37, finding 4): no input crashes it, and an ADD of
a URL is found however the builder's syntax hides it (continuations, either escape character, case, JSON, flags,
ONBUILD, stages, comments)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from coldsnap_runtime.dockerfile import remote_sources

_URLS = st.sampled_from([
    "http://127.0.0.1:8080/secret", "https://127.0.0.1/x.tar", "http://[::1]:9/a", "HTTP://localhost/a",
    "https://user:pw@10.0.0.1/k", "git@github.com:org/repo.git", "http://169.254.169.254/latest/meta-data/",
])
_NOISE = st.sampled_from([
    "RUN true", "COPY a /a", "# a comment", "", "   ", "ARG X=1", "ENV A=b", "WORKDIR /w", "LABEL k=v",
    "RUN echo http://not-fetched.example/ # RUN runs in a build container, not in the engine",
    "COPY --from=stage /x /y", "USER 1000",
])


@given(st.text())
def test_remote_sources_any_text_never_crashes(text: str) -> None:
    found = remote_sources(text)
    assert all(source.line >= 1 and source.why in ("url", "git", "variable") for source in found)


@given(st.binary())
def test_remote_sources_any_bytes_decoded_as_the_policy_does_never_crash(data: bytes) -> None:
    remote_sources(data.decode("utf-8", "replace"))


@st.composite
def _hidden_add(draw: st.DrawFn) -> tuple[str, int, str]:
    """(Dockerfile, the line its ADD starts on, the URL) with one ADD of a URL hidden some way the builder reads."""
    url = draw(_URLS)
    escape = draw(st.sampled_from(["\\", "`"]))
    keyword = "".join(draw(st.sampled_from([c.lower(), c.upper()])) for c in "add")
    onbuild = draw(st.sampled_from(["", "ONBUILD ", "onbuild ", "OnBuild\t"]))
    flags = draw(st.sampled_from(["", "--chown=1:1 ", "--chmod=644 ", "--checksum=sha256:00 ", "-- ", "--link "]))
    quote = draw(st.sampled_from(["", '"', "'"]))
    arguments = json.dumps([url, "/dest"]) if draw(st.booleans()) else f"{quote}{url}{quote} /dest"
    text = f"{onbuild}{keyword} {flags}{arguments}"
    # Break the instruction at arbitrary points with continuations; comments and blank lines may sit between.
    cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=len(text) - 1), max_size=4)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    lines: list[str] = []
    for index, piece in enumerate(pieces):
        lines.append(piece + (escape + draw(st.sampled_from(["", " ", "\t"])) if index < len(pieces) - 1 else ""))
        if index < len(pieces) - 1:
            lines += draw(st.lists(st.sampled_from(["# inside", "  # indented", "", "  "]), max_size=2))
    before = draw(st.lists(_NOISE, max_size=4))
    header = [f"# escape={escape}"] if escape == "`" else []
    stages = ["FROM busybox AS one", *before, "FROM scratch"] if draw(st.booleans()) else ["FROM busybox", *before]
    after = draw(st.lists(_NOISE, max_size=3))
    head = [*header, *stages]
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    return newline.join([*head, *lines, *after]) + newline, len(head) + 1, url


@given(_hidden_add())
def test_remote_sources_finds_an_add_of_a_url_however_it_is_written(case: tuple[str, int, str]) -> None:
    text, line, url = case
    found = remote_sources(text)
    # The first is the instruction as the builder reads it (what a refusal names); reading under the other
    # escape character may add pieces of it on later lines, never fewer.
    assert found and (found[0].line, found[0].why) == (line, "git" if url.startswith("git@") else "url"), text
    assert all(s.line >= line for s in found) and all("pw@" not in s.source for s in found)  # credentials masked


def test_remote_sources_local_adds_copies_and_runs_are_not_remote() -> None:
    text = ("FROM busybox\nADD app.tar.gz /app\nadd [\"a b\", \"/c\"]\nCOPY http://example/x /x\n"
            "RUN wget http://127.0.0.1/\nADD local /$HOME/dest\nONBUILD COPY . /src\n")
    assert remote_sources(text) == []


def test_remote_sources_a_variable_source_may_become_a_url() -> None:
    [found] = remote_sources("ARG U\nFROM busybox\nADD --chown=1 ${U} /x\n")
    assert (found.line, found.instruction, found.source, found.why) == (3, "ADD", "${U}", "variable")
