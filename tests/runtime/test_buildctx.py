"""Named build contexts for the classic builder: Dockerfile rewriting and the context tar.

The tar is written by the real packer program (``_archive.py --pack``), as root and as the
real ``nobody`` user.
"""

from __future__ import annotations

import io
import os
import pwd
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

import coldsnap_runtime.backend._archive as archive_module
from coldsnap_runtime import Owner
from coldsnap_runtime.backend._buildctx import (
    DOCKERFILE_PATH,
    base_images,
    rewrite_dockerfile,
    write_context_tar,
)
from coldsnap_runtime.errors import BuildContextError, RuntimeFailed

NOBODY = pwd.getpwnam("nobody")
AS_NOBODY = Owner(NOBODY.pw_uid, NOBODY.pw_gid)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="changes identity: needs root")

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
    # (the builder joins a continued line with nothing between: "echo " + "  hi")
    assert "FROM img:1 AS b" in out and "COPY --from=b /x /y" in out and "RUN echo   hi" in out


def test_buildkit_only_mounts_are_refused() -> None:
    with pytest.raises(BuildContextError, match="BuildKit"):
        rewrite_dockerfile("RUN --mount=type=cache,from=coldsnap_seed,target=/x true\n", CTX)


async def pack_bytes(context: Path | str, contexts: dict[str, str] | None = None, *, owner: Owner | None = None,
                     dockerfile: bytes = b"FROM x\n") -> bytes:
    with tempfile.TemporaryFile() as out:  # the packer writes to the file's descriptor, like the backend's spool
        await write_context_tar(out, context=str(context), contexts=contexts or {}, dockerfile=dockerfile,
                                owner=owner)
        out.seek(0)
        return out.read()


async def pack(context: Path | str, contexts: dict[str, str] | None = None, *, owner: Owner | None = None,
               dockerfile: bytes = b"FROM x\n") -> tarfile.TarFile:
    return tarfile.open(fileobj=io.BytesIO(await pack_bytes(context, contexts, owner=owner, dockerfile=dockerfile)))


async def test_context_tar_holds_context_named_contexts_and_dockerfile(tmp_path: Path) -> None:
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "keep.txt").write_text("k")
    (tmp_path / "ctx" / "skip.log").write_text("s")
    (tmp_path / "ctx" / ".dockerignore").write_text("*.log\n")
    (tmp_path / "seed" / "root").mkdir(parents=True)
    (tmp_path / "seed" / "root" / "f").write_text("seed")
    with await pack(tmp_path / "ctx", {"coldsnap_seed": str(tmp_path / "seed")},
                    dockerfile=b"FROM x\nCOPY --from=coldsnap_seed /root /root\n") as tar:
        names = tar.getnames()
        dockerfile = tar.extractfile(DOCKERFILE_PATH).read()  # type: ignore[union-attr]
        owners = {(m.uid, m.gid) for m in tar.getmembers()}
        seed = tar.extractfile(".coldsnap-contexts/coldsnap_seed/root/f").read()  # type: ignore[union-attr]
    assert "keep.txt" in names and "skip.log" not in names
    assert ".coldsnap-contexts/coldsnap_seed/root/f" in names and seed == b"seed"
    assert dockerfile == b"FROM x\nCOPY .coldsnap-contexts/coldsnap_seed/root /root\n"
    assert owners == {(0, 0)}


async def test_context_tar_missing_context_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(BuildContextError, match=r"contexts\['seed'\] /nope is not a directory"):
        await pack(tmp_path, {"seed": "/nope"})


async def test_context_tar_reserved_name_in_the_context_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".coldsnap-build").mkdir()
    with pytest.raises(BuildContextError, match=r"must not contain '\.coldsnap-build'"):
        await pack(tmp_path)


@needs_root
async def test_context_tar_as_nobody_unreadable_path_fails_naming_it(top: Path) -> None:
    """Regression: image-build read context directories as root: a manager could build any host file in."""
    context = top / "ctx"
    (context / "private").mkdir(parents=True)
    (context / "private" / "key").write_text("root's secret\n")
    (context / "private").chmod(0o700)
    (context / "readable.txt").write_text("r\n")
    with await pack(context) as tar:  # the daemon's own identity reads it: the rule below is the owner's
        assert tar.extractfile("private/key").read() == b"root's secret\n"  # type: ignore[union-attr]
    with pytest.raises(BuildContextError, match=rf"cannot read {context}/private: Permission denied") as caught:
        await pack(context, owner=AS_NOBODY)
    assert isinstance(caught.value, RuntimeFailed) and caught.value.error_code == "runtime_failed"
    (context / "private").chmod(0o755)
    (context / "private" / "key").chmod(0o600)
    with pytest.raises(BuildContextError, match=rf"cannot read {context}/private/key: Permission denied"):
        await pack(context, owner=AS_NOBODY)
    (context / "private" / "key").chmod(0o644)
    seed = top / "seed"
    seed.mkdir(mode=0o700)
    with pytest.raises(BuildContextError, match=rf"cannot read {seed}: Permission denied"):
        await pack(top / "ctx", {"s": str(seed)}, owner=AS_NOBODY, dockerfile=b"FROM s\n")


@needs_root
@pytest.mark.parametrize("owner", [None, AS_NOBODY], ids=["as-root", "as-nobody"])
async def test_context_tar_symlinks_are_archived_as_links_never_followed(top: Path, owner: Owner | None) -> None:
    context = top / "ctx"
    context.mkdir()
    (context / "shadow").symlink_to("/etc/shadow")
    (context / "etc").symlink_to("/etc")
    (context / "dangling").symlink_to("/nonexistent/target")
    shadow_head = Path("/etc/shadow").read_bytes().split(b"\n")[0]
    data = await pack_bytes(context, owner=owner)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["shadow"].issym() and members["shadow"].linkname == "/etc/shadow"
    assert members["etc"].issym() and members["etc"].linkname == "/etc"
    assert members["dangling"].issym()
    assert not any(name.startswith("etc/") for name in members)  # the linked directory is not entered
    assert shadow_head and shadow_head not in data


@needs_root
async def test_context_tar_dockerignored_unreadable_directory_is_never_opened(top: Path) -> None:
    context = top / "ctx"
    (context / "cache").mkdir(parents=True)
    (context / "cache").chmod(0o700)
    (context / "app.txt").write_text("a")
    (context / ".dockerignore").write_text("cache\n")
    with await pack(context, owner=AS_NOBODY) as tar:
        assert sorted(tar.getnames()) == [".coldsnap-build/Dockerfile", ".dockerignore", "app.txt"]


def test_pack_program_bad_arguments_exit_2() -> None:
    result = subprocess.run([sys.executable, "-I", "-S", archive_module.__file__, "--pack", "extra"],
                            input=b"{}", capture_output=True, check=False)
    assert result.returncode == 2 and b"usage: _archive.py --pack" in result.stderr


def test_base_images_skip_stages_and_scratch_and_substitute_args() -> None:
    text = "ARG BASE=img:1\nFROM ${BASE} AS a\nFROM scratch\nFROM a\nFROM --platform=linux/amd64 other:2 AS b\n"
    assert base_images(text, {}) == ["img:1", "other:2"]
    assert base_images(text, {"BASE": "local:9"}) == ["local:9", "other:2"]


def test_lines_end_only_where_the_builders_do_and_continuations_join_with_nothing_between() -> None:
    """Regression: #37 review: str.splitlines() also broke lines at \\r, \\f, \\x85, U+2028 ..., so the
    rewritten Dockerfile held an `ADD <url>` line the policy had read as part of a RUN; and a continued FROM
    was joined with a space, so the ONBUILD check inspected a decoy base."""
    for separator in ("\r", "\x0c", "\x0b", "\x1c", "\x85", "\u2028", "\u2029"):
        out = rewrite_dockerfile(f"FROM x\nRUN true{separator}ADD http://127.0.0.1:1/s /s\n", {"c": "/d"})
        assert not [line for line in out.split("\n") if line.lstrip().upper().startswith("ADD")], repr(out)
    assert base_images("FROM review-x/o\\\nnb000001:1\nRUN true\n", {}) == ["review-x/onb000001:1"]
    # Under either escape character (engines differ on when they honour the directive), every base is checked.
    assert set(base_images("# escape=`\nFROM a/b`\nc:1\n", {})) >= {"a/bc:1"}
