"""huggingface-publish / huggingface-resolve: the real daemon, the real `huggingface_hub` client,
a local Hub server (tests/provider/_hubserver.py), and the payload opened as exec.user ("nobody")."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from coldsnap_provider._envelope import Reply
from tests.helpers import Daemon, Session, running_daemon, session_as
from tests.provider._hubserver import HubRepo, HubServer, running_hub

WRITE_TOKEN = "hf_writer_" + "w" * 24
READ_TOKEN = "hf_reader_" + "r" * 24
REPO = "org/model-native"
IMAGE = "registry.example/capsules/m@sha256:05b3abf2579a5eb66403cd78be557fd860633a1fe2103c7642030defe32c657f"
REFERENCE_ORDER = ["exec", "huggingface-publish", "huggingface-resolve", "oci-pull", "oci-push", "runtime-v1",
                   "upload"]


@pytest.fixture
def hub() -> Iterator[HubServer]:
    server = HubServer(tokens={WRITE_TOKEN: "write", READ_TOKEN: "read"}, repos={REPO: HubRepo.new()},
                       lfs_threshold=1 << 20)
    with running_hub(server) as running:
        yield running


@asynccontextmanager
async def hub_daemon(hub: HubServer, token: str = WRITE_TOKEN, request_timeout_s: float = 10.0,
                     unit: bool | None = None) -> AsyncIterator[tuple[Daemon, Session]]:
    secrets_dir = Path(tempfile.mkdtemp(prefix="cs-hf-token-"))
    token_file = secrets_dir / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    config = (f'[exec]\nuser = "nobody"\n[huggingface]\ntoken_file = "{token_file}"\nendpoint = "{hub.url}"\n'
              f'request_timeout_s = {request_timeout_s}\noperation_timeout_s = 15.0\n')
    try:
        async with running_daemon(config, unit=unit) as daemon:
            yield daemon, await daemon.open_session(hosts=["localhost"])
    finally:
        shutil.rmtree(secrets_dir, ignore_errors=True)


def text(reply: Reply) -> str:
    return reply.error if isinstance(reply.error, str) else ""


def names(reply: Reply) -> list[str]:
    return reply.capabilities if isinstance(reply.capabilities, list) else []


def payload(directory: Path, data: bytes, name: str = "native.pack") -> Path:
    path = directory / name
    path.write_bytes(data)
    path.chmod(0o644)
    return path


async def publish(session: Session, source: Path | str, *, revision: str = "staging",
                  repository: str = REPO, destination: str = "native/objects/0001.pack") -> Reply:
    return await session.call("huggingface-publish", host="localhost", image=IMAGE, repository=repository,
                              revision=revision, source=str(source), destination=destination)


async def resolve(session: Session, revision: str, *, repository: str = REPO) -> Reply:
    return await session.call("huggingface-resolve", host="localhost", image=IMAGE, repository=repository,
                              revision=revision)


async def test_publish_then_resolve_returns_the_new_commit_and_the_hub_holds_the_bytes(
        hub: HubServer, top: Path) -> None:
    small = os.urandom(4096)
    large = os.urandom((1 << 20) + 12345)  # past the server's LFS threshold: batch API, PUT, verify
    async with hub_daemon(hub) as (daemon, session):
        caps = await session.call("capabilities")
        assert caps.ok and caps.capabilities == REFERENCE_ORDER
        first = await publish(session, payload(top, small))
        assert first.ok, first.error
        second = await publish(session, payload(top, large, "big.pack"), destination="native/big.pack")
        assert second.ok, second.error
        resolved = await resolve(session, "staging")
        assert resolved.ok, resolved.error
        assert re.fullmatch(r"[0-9a-f]{40}", str(resolved.value))
        assert resolved.value == hub.repos[REPO].branches["staging"]
        assert resolved.value != hub.repos[REPO].branches["main"]
        log = daemon.log()
    files = hub.repos[REPO].files("staging")
    assert files == {"native/objects/0001.pack": small, "native/big.pack": large}
    assert any(path.startswith("/lfs-upload/") for _, path, _ in hub.requests)
    writes = [auth for method, path, auth in hub.requests if method == "POST" and "/commit/" in path]
    assert writes and all(auth == f"Bearer {WRITE_TOKEN}" for auth in writes)
    assert WRITE_TOKEN not in log


async def test_publish_with_an_invalid_token_is_runtime_failed_naming_the_repository(
        hub: HubServer, top: Path) -> None:
    bad = "hf_not_a_real_token_123456"
    async with hub_daemon(hub, token=bad) as (daemon, session):
        reply = await publish(session, payload(top, b"x" * 100))
        refused = await resolve(session, "main")
        log = daemon.log()
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert f"{REPO}@staging" in text(reply) and "authentication refused" in text(reply)
    assert "HTTP 401" in text(reply) and bad not in text(reply)
    assert not refused.ok and "HTTP 401" in text(refused)
    assert bad not in log
    assert hub.repos[REPO].branches.keys() == {"main"}


async def test_publish_with_a_read_only_token_is_permission_denied(hub: HubServer, top: Path) -> None:
    async with hub_daemon(hub, token=READ_TOKEN) as (_, session):
        hub.repos[REPO].branches["staging"] = hub.repos[REPO].branches["main"]
        reply = await publish(session, payload(top, b"x" * 100))
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert "permission denied" in text(reply) and "HTTP 403" in text(reply)
    assert f"{REPO}@staging" in text(reply)


async def test_missing_repository_and_missing_revision_are_runtime_failed(hub: HubServer,
                                                                          top: Path) -> None:
    async with hub_daemon(hub) as (_, session):
        published = await publish(session, payload(top, b"x"), repository="org/absent")
        resolved = await resolve(session, "main", repository="org/absent")
        revision = await resolve(session, "no-such-branch")
    for reply in (published, resolved):
        assert not reply.ok and reply.error_code == "runtime_failed"
        assert "org/absent@" in text(reply) and "repository not found" in text(reply)
        assert "HTTP 404" in text(reply)
    assert not revision.ok and revision.error_code == "runtime_failed"
    assert f"{REPO}@no-such-branch: revision not found" in text(revision)


async def test_connection_dropped_mid_upload_is_a_network_failure(hub: HubServer, top: Path) -> None:
    async with hub_daemon(hub) as (_, session):
        hub.drop_commit_after = 64  # the commit body carries the (regular-mode) payload
        reply = await publish(session, payload(top, os.urandom(64 << 10)), revision="main")
        again = await publish(session, payload(top, b"second try"), revision="main")
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert f"{REPO}@main: network failure" in text(reply)
    assert again.ok, again.error
    assert hub.repos[REPO].files("main") == {"native/objects/0001.pack": b"second try"}


async def test_silent_hub_is_a_network_timeout_within_the_configured_bound(hub: HubServer) -> None:
    async with hub_daemon(hub, request_timeout_s=0.5) as (_, session):
        hub.stall_s = 3.0
        reply = await resolve(session, "main")
        hub.stall_s = 0.0
        after = await resolve(session, "main")
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert f"{REPO}@main: network timeout" in text(reply) and "ReadTimeout" in text(reply)
    assert after.ok, after.error


async def test_resolve_refuses_an_answer_that_is_not_a_commit_id(hub: HubServer) -> None:
    async with hub_daemon(hub) as (_, session):
        hub.answer_sha = "main"
        reply = await resolve(session, "main")
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert "answered no commit id" in text(reply) and "'main'" in text(reply)


async def test_source_is_opened_as_exec_user_without_following_links(hub: HubServer, top: Path) -> None:
    secret = payload(top, b"root only")
    secret.chmod(0o600)  # root can read it; exec.user (nobody) cannot
    link = top / "link.pack"
    link.symlink_to(payload(top, b"target", "target.pack"))
    async with hub_daemon(hub) as (_, session):
        unreadable = await publish(session, secret)
        through_link = await publish(session, link)
        directory = await publish(session, top)
        absent = await publish(session, top / "absent.pack")
    assert not unreadable.ok and "Permission denied" in text(unreadable)
    assert not through_link.ok and "symbolic link" in text(through_link)
    assert not directory.ok and "not a regular file" in text(directory)
    assert not absent.ok and "No such file" in text(absent)
    assert "staging" not in hub.repos[REPO].branches  # nothing reached the Hub


async def test_unconfigured_daemon_neither_advertises_nor_serves_the_hub_operations() -> None:
    async with running_daemon() as daemon:
        session = await daemon.open_session(hosts=["localhost"])
        caps = await session.call("capabilities")
        reply = await resolve(session, "main")
    assert caps.ok and "huggingface-publish" not in names(caps)
    assert "huggingface-resolve" not in names(caps)
    assert not reply.ok and reply.error == "unsupported host-provider capability 'huggingface-resolve'"


async def test_requests_with_a_bad_image_repository_or_path_are_rejected_before_any_call(
        hub: HubServer, top: Path) -> None:
    source = payload(top, b"x")
    async with hub_daemon(hub) as (_, session):
        bad_image = await session.call("huggingface-resolve", host="localhost", image="Not An Image",
                                       repository=REPO, revision="main")
        bad_repo = await resolve(session, "main", repository="no-namespace")
        escaping = await publish(session, source, destination="../outside.pack")
        missing_image = await session.call("huggingface-resolve", host="localhost", repository=REPO,
                                           revision="main")
    assert not bad_image.ok and "OCI image reference" in text(bad_image)
    assert not bad_repo.ok and "$.repository" in text(bad_repo)
    assert not escaping.ok and "$.destination" in text(escaping)
    assert not missing_image.ok and "image" in text(missing_image)
    assert not [r for r in hub.requests if r[0] != "GET" or "revision" not in r[1]]
    assert not hub.requests


@pytest.mark.skipif(os.geteuid() != 0, reason="reproduces the unit's account: needs root")
async def test_publish_and_resolve_under_the_shipped_unit_open_the_source_as_exec_user(
        hub: HubServer, top: Path) -> None:
    """The unit once allowed only AF_UNIX sockets: every Hub call failed. The source opener runs as
    exec.user with no capability: a root-only source stays unreadable (docs/systemd.md)."""
    data = os.urandom(2048)
    secret = payload(top, b"root only", "secret.pack")
    secret.chmod(0o600)
    async with hub_daemon(hub, unit=True) as (_, session):
        published = await publish(session, payload(top, data))
        assert published.ok, published.error
        resolved = await resolve(session, "staging")
        assert resolved.ok and resolved.value == hub.repos[REPO].branches["staging"], resolved
        refused = await publish(session, secret, destination="native/secret.pack")
        assert not refused.ok and "Permission denied" in text(refused), refused
    assert hub.repos[REPO].files("staging") == {"native/objects/0001.pack": data}


# --- issue 37, finding 2: Hub repositories have owners and profiles name them ---------------------------------

MANAGER_A, MANAGER_B, CAPSULE_MANAGER = 65534, 65533, 65532
OWNED = "Org/Model-Native"  # REPO as another spelling: the Hub compares repository ids without regard to case


@asynccontextmanager
async def managers_daemon(hub: HubServer, state_dir: Path, audit: Path,
                          patterns: str = '["org/*", "Org/*"]') -> AsyncIterator[Daemon]:
    """A daemon whose managers A and B share the profile `tenant` (Hub repositories `patterns`); a third
    manager gets the built-in `capsule`. `state_dir` outlives the daemon (ownership survives restarts)."""
    secrets_dir = Path(tempfile.mkdtemp(prefix="cs-hf-token-"))
    token_file = secrets_dir / "token"
    token_file.write_text(WRITE_TOKEN + "\n")
    token_file.chmod(0o600)
    config = (f'[exec]\nuser = "nobody"\n[huggingface]\ntoken_file = "{token_file}"\nendpoint = "{hub.url}"\n'
              f"[server]\ncontrol_uids = [{MANAGER_A}, {MANAGER_B}, {CAPSULE_MANAGER}]\n"
              f'[audit]\nfile = "{audit}"\n'
              f"[policy.profiles.tenant]\nhuggingface_repos = {patterns}\n"
              f'[[policy.assign]]\nuids = [{MANAGER_A}, {MANAGER_B}]\nprofile = "tenant"\n')
    try:
        async with running_daemon(config, state_dir=state_dir) as daemon:
            yield daemon
    finally:
        shutil.rmtree(secrets_dir, ignore_errors=True)


def audited(audit: Path, operation: str) -> list[tuple[str, str, str, int, str]]:
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    return [(e["outcome"], e["decision"], e["profile"], e["uid"], e["error"]) for e in events
            if e["operation"] == operation]


async def test_publish_over_another_managers_repository_is_refused_audited_and_uploads_nothing(
        hub: HubServer, top: Path) -> None:
    """Regression: #37 finding 2: manager B published its own bytes over manager A's repository with the
    node's one token. The first manager to publish owns the repository, across restarts; root reaches all."""
    hub.repos["org/b-model"] = HubRepo.new()
    state_dir, audit = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp")), top / "audit.jsonl"
    refusal = (f"repository: {REPO} belongs to another manager (its sessions published there first); a manager "
               "publishes only to repositories that are its own or that no session published to")
    try:
        async with managers_daemon(hub, state_dir, audit) as daemon:
            a, b = session_as(MANAGER_A, daemon), session_as(MANAGER_B, daemon)
            first = await publish(a, payload(top, b"A's weights", "a.pack"))
            assert first.ok, first.error
            before = len(hub.requests)
            theirs = await publish(b, payload(top, b"B's bytes", "b.pack"))
            assert not theirs.ok and not theirs.error_code and theirs.error == refusal, theirs
            spelled = await publish(b, payload(top, b"B's bytes", "b.pack"), repository=OWNED)
            assert spelled.error == refusal.replace(REPO, OWNED), spelled
            assert len(hub.requests) == before  # refused before the Hub was asked anything
            read = await resolve(b, "staging")  # reading stays the allow-list's alone
            assert read.ok and read.value == hub.repos[REPO].branches["staging"], read
            own = await publish(b, payload(top, b"B's own", "b2.pack"), repository="org/b-model", revision="main")
            assert own.ok, own.error
            mine = await publish(a, payload(top, b"A again", "a2.pack"), repository="org/b-model", revision="main")
            assert not mine.ok and "repository: org/b-model belongs to another manager" in text(mine)
            admin = await publish(await daemon.open_session(), payload(top, b"root", "r.pack"),
                                  destination="native/root.pack")
            assert admin.ok, admin.error  # root and the daemon's uid reach every repository
        owners = json.loads((state_dir / "huggingface-owners.json").read_text())
        assert owners["owners"] == {"org/model-native": MANAGER_A, "org/b-model": MANAGER_B}
        async with managers_daemon(hub, state_dir, audit) as daemon:  # the owners survive a restart
            a, b = session_as(MANAGER_A, daemon), session_as(MANAGER_B, daemon)
            again = await publish(b, payload(top, b"B's bytes", "b.pack"))
            assert not again.ok and again.error == refusal, again
            assert (await publish(a, payload(top, b"A's next", "a3.pack"), destination="native/next.pack")).ok
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    assert hub.repos[REPO].files("staging") == {"native/objects/0001.pack": b"A's weights",
                                                 "native/root.pack": b"root", "native/next.pack": b"A's next"}
    assert hub.repos["org/b-model"].files("main") == {"native/objects/0001.pack": b"B's own"}
    events = audited(audit, "huggingface-publish")
    assert ("rejected", "refused", "tenant", MANAGER_B, refusal) in events
    assert [e[:4] for e in events] == [
        ("ok", "admitted", "tenant", MANAGER_A), ("rejected", "refused", "tenant", MANAGER_B),
        ("rejected", "refused", "tenant", MANAGER_B), ("ok", "admitted", "tenant", MANAGER_B),
        ("rejected", "refused", "tenant", MANAGER_A),
        ("ok", "admitted", "unrestricted", 0), ("rejected", "refused", "tenant", MANAGER_B),
        ("ok", "admitted", "tenant", MANAGER_A)]


async def test_hub_repositories_outside_the_profile_are_refused_naming_the_field_value_and_rule(
        hub: HubServer, top: Path) -> None:
    """Regression: #37 finding 2: no policy rule covered Hub repositories; `capsule` now names none."""
    state_dir, audit = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp")), top / "audit.jsonl"
    try:
        async with managers_daemon(hub, state_dir, audit, patterns='["org/model-*"]') as daemon:
            tenant, capsule = session_as(MANAGER_A, daemon), session_as(CAPSULE_MANAGER, daemon)
            source = payload(top, b"x")
            outside = await publish(tenant, source, repository="elsewhere/model")
            read = await resolve(tenant, "main", repository="elsewhere/model")
            none = await publish(capsule, source)
            none_read = await resolve(capsule, "main")
            inside = await resolve(tenant, "main")
            log = daemon.log_events()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    assert outside.error == ("repository: elsewhere/model matches none of the Hugging Face repositories profile "
                             "tenant allows (org/model-*)"), outside
    assert read.error == outside.error and not read.error_code
    assert none.error == (f"repository: {REPO} matches none of the Hugging Face repositories profile capsule "
                          "allows (none: set huggingface_repos)"), none
    assert none_read.error == none.error
    assert inside.ok and inside.value == hub.repos[REPO].branches["main"]
    assert [path for _, path, _ in hub.requests] == [f"/api/models/{REPO}/revision/main"]  # only the admitted one
    refused = [(e["action"], e["rule"]) for e in log if e.get("event") == "admission" and e["decision"] == "refused"]
    assert refused == [("huggingface-publish", "huggingface-repos"), ("huggingface-resolve", "huggingface-repos")] * 2
    assert [e[:4] for e in audited(audit, "huggingface-publish")] == [
        ("rejected", "refused", "tenant", MANAGER_A), ("rejected", "refused", "capsule", CAPSULE_MANAGER)]


async def test_a_first_publish_that_fails_keeps_no_repository(hub: HubServer, top: Path) -> None:
    """A reservation is given back when the publish fails: a manager cannot hold a repository (one the
    Hub does not have yet, say) that it never published to."""
    state_dir, audit = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp")), top / "audit.jsonl"
    try:
        async with managers_daemon(hub, state_dir, audit) as daemon:
            a, b = session_as(MANAGER_A, daemon), session_as(MANAGER_B, daemon)
            failed = await publish(b, payload(top, b"B", "b.pack"), repository="org/later")
            assert failed.error_code == "runtime_failed" and "repository not found" in text(failed), failed
            hub.repos["org/later"] = HubRepo.new()
            published = await publish(a, payload(top, b"A", "a.pack"), repository="org/later")
            assert published.ok, published.error
            refused = await publish(b, payload(top, b"B", "b.pack"), repository="org/later")
            assert "org/later belongs to another manager" in text(refused), refused
        assert json.loads((state_dir / "huggingface-owners.json").read_text())["owners"] == {"org/later": MANAGER_A}
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
