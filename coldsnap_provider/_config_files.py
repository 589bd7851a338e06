"""The files a configuration names, checked the way the daemon will use them, and as the account it runs as.

``check-config`` runs :func:`file_problems`: each ``[[kubernetes]]`` kubeconfig (YAML, its current context,
cluster and user, then kubernetes_asyncio's own loader, as the backend loads it) and the files it refers to;
each ``[[remote]]`` identity file (a private key asyncssh loads without a passphrase, not open to group or
other) and known_hosts (asyncssh parses it); ``[registry] credentials_file`` (a JSON object) and
``[huggingface] token_file`` (one token). Every problem is one line naming the key, the path and the rule.

Readability is tried, not computed: a child process takes the account's uid, primary gid and supplementary
groups and opens each file (so ACLs, read-only mounts and every directory on the way count, as they will for
the daemon). Checking another account than one's own needs root. ``serve`` runs :func:`kubeconfig_problems`
before it starts, so that a malformed kubeconfig stops it with the same line instead of a traceback.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
from typing import Any

import msgspec

from ._errors import ConfigError

__all__ = ("Account", "NamedFiles", "account_named", "file_problems", "kubeconfig_problems")

_TOKEN_LIMIT = 4096  # a Hub token is tens of bytes; the daemon reads at most this much (_huggingface.py)


class Account(msgspec.Struct, frozen=True, kw_only=True):
    """Who the daemon runs as: the files it names must be readable with these ids."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]

    def describe(self) -> str:
        return f"user {self.name} (uid {self.uid}, groups {','.join(str(g) for g in self.groups)})"


def account_named(name: str | None) -> Account:
    """The account `name` (a user name or uid), or the current process's own ids when None."""
    if name is None:
        groups = tuple(sorted({os.getegid(), *os.getgroups()}))
        try:
            user = pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:
            user = str(os.geteuid())
        return Account(name=user, uid=os.geteuid(), gid=os.getegid(), groups=groups)
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(f"--as-user {name!r}: no such user") from None
    groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))))
    return Account(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, groups=groups)


class NamedFiles(msgspec.Struct, frozen=True, kw_only=True):
    """The files a configuration names (cli.py fills it from Config: this module does not import _config)."""

    kubeconfigs: list[str]  # [[kubernetes]] kubeconfig, by entry
    ssh: list[tuple[str, str]]  # [[remote]] (identity_file, known_hosts), by entry
    credentials_file: str = ""  # [registry]
    token_file: str = ""  # [huggingface]


def file_problems(files: NamedFiles, account: Account) -> list[str]:
    """Every problem of every named file (content checked by this process, reading by `account`)."""
    problems = kubeconfig_problems(files.kubeconfigs)
    named: list[tuple[str, str]] = []  # (key, path) the daemon opens
    for index, kubeconfig in enumerate(files.kubeconfigs):
        named.append((f"kubernetes[{index}].kubeconfig", kubeconfig))
        named += _kubeconfig_files(f"kubernetes[{index}].kubeconfig", kubeconfig)
    for index, (identity_file, known_hosts) in enumerate(files.ssh):
        key = f"remote[{index}]"
        named += [(f"{key}.identity_file", identity_file), (f"{key}.known_hosts", known_hosts)]
        problems += _ssh_problems(key, identity_file, known_hosts)
    if path := files.credentials_file:
        named.append(("registry.credentials_file", path))
        problems += _content_problem("registry.credentials_file", path, _credentials_rule)
    if path := files.token_file:
        named.append(("huggingface.token_file", path))
        problems += _content_problem("huggingface.token_file", path, _token_rule)
    unreadable = _unreadable_as(account, sorted({path for _, path in named}))
    named_already = {path for _, path in named if any(f": {path}: " in problem for problem in problems)}
    problems += [f"{key}: {path}: not readable by {account.describe()}: {unreadable[path]}"
                 for key, path in named if path in unreadable and path not in named_already]
    return problems


def kubeconfig_problems(kubeconfigs: list[str]) -> list[str]:
    """Each [[kubernetes]] kubeconfig: readable, YAML, a current context whose cluster and user it lists, and
    accepted by kubernetes_asyncio's loader (the backend's own), certificate files included."""
    problems = []
    for index, kubeconfig in enumerate(kubeconfigs):
        if problem := _kubeconfig_problem(kubeconfig):
            problems.append(f"kubernetes[{index}].kubeconfig: {kubeconfig}: {problem}")
    return problems


def _kubeconfig_problem(path: str) -> str:
    try:
        document = _yaml(path)
    except OSError as exc:
        return str(exc.strerror or exc)
    except ValueError as exc:
        return str(exc)
    if problem := _kubeconfig_shape(document):
        return problem
    from concurrent.futures import ThreadPoolExecutor

    import anyio
    from kubernetes_asyncio import client, config

    async def load() -> None:
        await config.load_kube_config(config_file=path, client_configuration=client.Configuration(),
                                      persist_config=False)

    try:  # in a thread of its own: a reload (SIGHUP) checks from inside the daemon's running event loop
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(lambda: anyio.run(load, backend="asyncio")).result()
    except Exception as exc:  # the loader's errors are of many kinds (ConfigException, TypeError, OSError)
        return f"kubernetes_asyncio refuses it: {exc}"
    return ""


def _yaml(path: str) -> Any:
    import yaml  # kubernetes_asyncio's own YAML library

    with open(path, "rb") as f:
        data = f.read()
    try:
        return yaml.safe_load(data)
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ValueError(f"not YAML: {first}{where}") from exc


def _named(document: dict[str, Any], section: str, name: Any) -> dict[str, Any] | None:
    for entry in document.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            body = entry.get(section.removesuffix("s"))
            return body if isinstance(body, dict) else {}
    return None


def _kubeconfig_shape(document: Any) -> str:
    """The keys the backend needs, named when missing (the loader's own errors are a TypeError for some)."""
    if not isinstance(document, dict):
        return "not a kubeconfig (a YAML mapping with clusters, users, contexts and current-context)"
    current = document.get("current-context")
    if not current:
        return "current-context is missing or empty"
    context = _named(document, "contexts", current)
    if context is None:
        return f"current-context {current!r} is not one of its contexts"
    for key, section in (("cluster", "clusters"), ("user", "users")):
        if _named(document, section, context.get(key)) is None:
            return f"context {current!r} names {key} {context.get(key)!r}, which its {section} do not list"
    cluster = _named(document, "clusters", context.get("cluster")) or {}
    if not cluster.get("server"):
        return f"cluster {context.get('cluster')!r} has no server"
    return ""


def _kubeconfig_files(key: str, path: str) -> list[tuple[str, str]]:
    """The files the current context refers to (certificates, keys, a token file), relative to the kubeconfig."""
    try:
        document = _yaml(path)
    except (OSError, ValueError):
        return []
    if not isinstance(document, dict) or _kubeconfig_shape(document):
        return []
    context = _named(document, "contexts", document["current-context"]) or {}
    files = []
    for section, field, names in (("clusters", "cluster", ("certificate-authority",)),
                                  ("users", "user", ("client-certificate", "client-key", "tokenFile"))):
        body = _named(document, section, context.get(field)) or {}
        for name in names:
            if isinstance(value := body.get(name), str) and value:
                where = os.path.join(os.path.dirname(path), value)
                files.append((f"{key} ({section}[{context.get(field)}].{name})", where))
    return files


def _ssh_problems(key: str, identity_file: str, known_hosts: str) -> list[str]:
    import asyncssh

    problems = []
    try:
        mode = os.stat(identity_file).st_mode
        asyncssh.read_private_key(identity_file)
        if stat.S_IMODE(mode) & 0o077:
            problems.append(f"{key}.identity_file: {identity_file}: mode {stat.S_IMODE(mode):04o} opens the private "
                            "key to group or other (chmod 600 it)")
    except OSError as exc:
        problems.append(f"{key}.identity_file: {identity_file}: {exc.strerror or exc}")
    except (asyncssh.KeyImportError, ValueError) as exc:
        problems.append(f"{key}.identity_file: {identity_file}: not a private key asyncssh can load without a "
                        f"passphrase: {exc}")
    try:
        asyncssh.read_known_hosts(known_hosts)
    except OSError as exc:
        problems.append(f"{key}.known_hosts: {known_hosts}: {exc.strerror or exc}")
    except ValueError as exc:
        problems.append(f"{key}.known_hosts: {known_hosts}: {exc}")
    return problems


def _content_problem(key: str, path: str, rule: Any) -> list[str]:
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError as exc:
        return [f"{key}: {path}: {exc.strerror or exc}"]
    problem: str = rule(data)
    return [f"{key}: {path}: {problem}"] if problem else []


def _credentials_rule(data: bytes) -> str:
    try:
        document = json.loads(data)
    except ValueError as exc:
        return f"not JSON: {exc}"
    return "" if isinstance(document, dict) else "must hold a JSON object (registry -> credentials)"


def _token_rule(data: bytes) -> str:
    token = data.decode("utf-8", "replace").strip()
    if not token or len(data) > _TOKEN_LIMIT or any(c.isspace() for c in token):
        return "must hold one token (non-empty, one line)"
    return ""


def _unreadable_as(account: Account, paths: list[str]) -> dict[str, str]:
    """path -> why `account` cannot open it for reading, tried by a child process holding the account's ids."""
    own = (account.uid, account.gid) == (os.geteuid(), os.getegid()) and set(account.groups) == {
        os.getegid(), *os.getgroups()}
    if own or not paths:
        return _open_errors(paths)
    if os.geteuid() != 0:
        raise ConfigError(f"--as-user {account.name}: trying files as another account needs root")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: take the account's ids, try, report, exit
        code = 1
        try:
            os.close(read_fd)
            os.setgroups(list(account.groups))
            os.setgid(account.gid)
            os.setuid(account.uid)
            with os.fdopen(write_fd, "wb") as out:
                out.write(msgspec.json.encode(_open_errors(paths)))
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as source:
        data = source.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise ConfigError(f"--as-user {account.name}: could not take the account's ids to try its files")
    return msgspec.json.decode(data, type=dict[str, str])


def _open_errors(paths: list[str]) -> dict[str, str]:
    errors = {}
    for path in paths:
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            errors[path] = str(exc.strerror or exc)
    return errors

