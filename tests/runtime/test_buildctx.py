"""Named build contexts for the classic builder: Dockerfile rewriting and the context tar."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from coldsnap_runtime.backend._buildctx import (
    DOCKERFILE_PATH,
    base_images,
    rewrite_dockerfile,
    write_context_tar,
)
from coldsnap_runtime.errors import BuildContextError

CTX = {"coldsnap_seed": "/seed", "base": "/base"}


def test_copy_from_a_named_context_reads_its_directory() -> None:
    out = rewrite_dockerfile("COPY --from=coldsnap_seed --chown=1:2 /root/.cache /a b /dst\n", CTX)
    assert out == ("COPY --chown=1:2 .coldsnap-contexts/coldsnap_seed/root/.cache "
                   ".coldsnap-contexts/coldsnap_seed/a .coldsnap-contexts/coldsnap_seed/b /dst\n")


def test_copy_from_json_form() -> None:
    out = rewrite_dockerfile('COPY --from=coldsnap_seed ["/x", "/y"]\n', CTX)
    assert out == 'COPY [".coldsnap-contexts/coldsnap_seed/x", "/y"]\n'


def test_from_a_named_context_becomes_its_directory_as_rootfs() -> None:
    out = rewrite_dockerfile("FROM base AS stage\nRUN true\n", CTX)
    assert out == "FROM scratch AS stage\nCOPY .coldsnap-contexts/base/ /\nRUN true\n"


def test_unrelated_instructions_stages_and_images_pass_through() -> None:
    text = "FROM img:1 AS b\nCOPY --from=b /x /y\nARG SOURCE_DATE_EPOCH=0\n# comment\nRUN echo \\\n  hi\n"
    out = rewrite_dockerfile(text, CTX)
    assert "FROM img:1 AS b" in out and "COPY --from=b /x /y" in out and "RUN echo    hi" in out


def test_buildkit_only_mounts_are_refused() -> None:
    with pytest.raises(BuildContextError, match="BuildKit"):
        rewrite_dockerfile("RUN --mount=type=cache,from=coldsnap_seed,target=/x true\n", CTX)


def test_context_tar_holds_context_named_contexts_and_dockerfile(tmp_path: Path) -> None:
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "keep.txt").write_text("k")
    (tmp_path / "ctx" / "skip.log").write_text("s")
    (tmp_path / "ctx" / ".dockerignore").write_text("*.log\n")
    (tmp_path / "seed" / "root").mkdir(parents=True)
    (tmp_path / "seed" / "root" / "f").write_text("seed")
    out = io.BytesIO()
    write_context_tar(out, context=str(tmp_path / "ctx"), contexts={"coldsnap_seed": str(tmp_path / "seed")},
                      dockerfile=b"FROM x\nCOPY --from=coldsnap_seed /root /root\n")
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:
        names = tar.getnames()
        dockerfile = tar.extractfile(DOCKERFILE_PATH).read()  # type: ignore[union-attr]
        owners = {(m.uid, m.gid) for m in tar.getmembers()}
    assert "keep.txt" in names and "skip.log" not in names
    assert ".coldsnap-contexts/coldsnap_seed/root/f" in names
    assert dockerfile == b"FROM x\nCOPY .coldsnap-contexts/coldsnap_seed/root /root\n"
    assert owners == {(0, 0)}


def test_missing_context_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(BuildContextError, match=r"contexts\['seed'\] /nope is not a directory"):
        write_context_tar(io.BytesIO(), context=str(tmp_path), contexts={"seed": "/nope"}, dockerfile=b"FROM x\n")


def test_base_images_skip_stages_and_scratch_and_substitute_args() -> None:
    text = "ARG BASE=img:1\nFROM ${BASE} AS a\nFROM scratch\nFROM a\nFROM --platform=linux/amd64 other:2 AS b\n"
    assert base_images(text, {}) == ["img:1", "other:2"]
    assert base_images(text, {"BASE": "local:9"}) == ["local:9", "other:2"]
