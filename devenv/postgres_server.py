"""A throwaway PostgreSQL server for tests and the local demo, over pytest-postgresql's executor.

Debian's binaries (or ``$POSTGRES_BIN_DIR``, or ``pg_ctl`` on ``PATH``); ``127.0.0.1`` only, on
a port kept across restarts (``run_dir/state.json``), ``trust`` auth for ``postgres``, fsync
off. As root, ``pg_ctl`` runs as the ``postgres`` system user (``setpriv``), with the data in a
private temporary directory when that user cannot reach ``run_dir``.

CLI: ``python -m devenv.postgres_server start|stop|status [--run-dir DIR] [--database NAME]``
(``start`` leaves the server running and prints the database's DSN as its last line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Self
from urllib.parse import quote

import psycopg
from mirakuru.base import ENV_UUID
from psycopg import sql
from pytest_postgresql.executors import PostgreSQLExecutor

from devenv.harness.ports import free_port

HOST = "127.0.0.1"
SUPERUSER = "postgres"
SYSTEM_USER = "postgres"
DEFAULT_RUN_DIR = Path(__file__).resolve().parent.parent / ".run" / "postgres"
DEFAULT_DATABASE = "user_activity"
_OPTIONS = {"listen_addresses": HOST, "max_connections": "200"}
# run by sh -c with pg_ctl, the data dir and a private base dir ("" for none)
_GUARD = 'read _; "$0" stop -D "$1" -m immediate; [ -z "$2" ] || rm -rf "$2"'


def _bin_dir() -> Path:
    """The directory of ``pg_ctl``: ``$POSTGRES_BIN_DIR``, Debian's newest, or ``PATH``."""
    candidates = [os.environ.get("POSTGRES_BIN_DIR", "")]
    candidates += [str(p) for p in sorted(
        Path("/usr/lib/postgresql").glob("*/bin"), reverse=True,
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else -1)]
    candidates.append(str(Path(shutil.which("pg_ctl") or "/nonexistent").resolve().parent))
    for candidate in filter(None, candidates):
        if os.access(Path(candidate) / "pg_ctl", os.X_OK):
            return Path(candidate)
    raise RuntimeError(
        "PostgreSQL server binaries not found: apt-get install postgresql, or set POSTGRES_BIN_DIR")


def _ensure_system_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir",
                        "/var/lib/postgresql", "--shell", "/usr/sbin/nologin", name],
                       check=True, capture_output=True)
        return pwd.getpwnam(name)


class _Executor(PostgreSQLExecutor):
    """The executor, keeping an existing cluster: restarts and new objects reuse its data."""

    detached = False

    @property
    def envvars(self) -> dict[str, str]:
        """Without mirakuru's mark: its exit hook kills by pid substring (recycled pids)."""
        env = super().envvars
        del env[ENV_UUID]
        return env

    def _kill_all_kids(self, sig: int) -> set[int]:
        """Nothing: mirakuru's scan of every process raced with vanishing ones."""
        return set()

    def start(self) -> Self:
        """Start; wait for ``pg_ctl start -w`` and forget it (mirakuru's kill would fail)."""
        super().start()
        if self.process is not None:
            self.process.wait(timeout=self._timeout)
        self._clear_process()
        return self

    def _build_initdb_command(self, initdb_options: list[str],
                              pgdata: str | None = None) -> list[str]:
        """Run initdb with ``--no-sync``: the server runs with fsync off anyway."""
        return super()._build_initdb_command([*initdb_options, "--no-sync"], pgdata)

    def init_directory(self) -> None:
        if not (Path(self.datadir) / "PG_VERSION").exists():
            super().init_directory()
        self._directory_initialised = True

    def clean_directory(self) -> None:
        """Never delete data implicitly (the executor does on GC); see PostgresServer.close."""


def _children(pid: int) -> list[int]:
    listed = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                            text=True, check=False).stdout.split()
    return [int(child) for child in listed]


def _signal(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # a backend may end meanwhile
            os.kill(pid, sig)


class PostgresServer:
    """One PostgreSQL cluster on 127.0.0.1 whose state lives in ``run_dir``.

    ``stop()`` then ``start()`` keeps port and data; ``close()`` also removes a private data
    dir. ``settings``: extra ``postgres -c`` options. Unless ``detach``, a guard process stops
    the server when this process ends, however it ends.
    """

    def __init__(self, run_dir: Path | None = None, *, settings: Mapping[str, str] | None = None,
                 detach: bool = False) -> None:
        self._owns_run_dir = run_dir is None
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="devenv-postgres-")).absolute()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        state_path = self.run_dir / "state.json"
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        user = _ensure_system_user(SYSTEM_USER) if os.geteuid() == 0 else None
        pg_ctl = _bin_dir() / "pg_ctl"
        base = self.run_dir
        if state.get("base_dir") and Path(state["base_dir"]).is_dir():
            base = Path(state["base_dir"])
        if user is not None:
            wrapper = self.run_dir / "pg_ctl"
            wrapper.write_text("#!/bin/sh\ncd / || exit 1\nexec setpriv --reuid="
                               f'{user.pw_uid} --regid={user.pw_gid} --init-groups {pg_ctl} "$@"\n')
            wrapper.chmod(0o755)
            pg_ctl = wrapper
            reachable = subprocess.run(
                ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups",
                 "test", "-x", str(base)], check=False, cwd="/",
            ).returncode == 0
            if not reachable:
                base = Path(tempfile.mkdtemp(prefix="devenv-pgdata-"))
                os.chown(base, user.pw_uid, user.pw_gid)
        self._relocated = base != self.run_dir
        self.port: int = state.get("port") or free_port(HOST)
        state_path.write_text(json.dumps({"port": self.port, "base_dir": str(base)}) + "\n")
        self.data_dir, self.log_path = base / "data", base / "postgres.log"
        options = {**_OPTIONS, **(settings or {})}
        self._executor = _Executor(
            executable=str(pg_ctl), host=HOST, port=self.port, datadir=str(self.data_dir),
            unixsocketdir="", logfile=str(self.log_path), startparams="-w", dbname="postgres",
            user=SUPERUSER, timeout=60,
            postgres_options=" ".join(f"-c {name}={value}" for name, value in options.items()))
        self._executor.detached = detach
        self._pg_ctl = pg_ctl
        self._guard: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The postmaster's pid, or ``None`` when it is not running."""
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def is_running(self) -> bool:
        """Whether the cluster's postmaster is alive (``pg_ctl status``)."""
        return self._executor.running()

    def dsn(self, dbname: str = "postgres") -> str:
        """``postgresql://postgres@127.0.0.1:PORT/DBNAME``."""
        return f"postgresql://{SUPERUSER}@{HOST}:{self.port}/{quote(dbname, safe='')}"

    def create_database(self, name: str) -> str:
        """Create database ``name`` unless it exists; return its DSN."""
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
                return self.dsn(name)
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn(name)

    def start(self) -> None:
        """Initialise the cluster on first use, start it and wait until it accepts connections."""
        if self.is_running():
            return
        if not (self.data_dir / "PG_VERSION").exists():
            shutil.rmtree(self.data_dir, ignore_errors=True)  # a half-made one is of no use
        user = pwd.getpwnam(SYSTEM_USER) if os.geteuid() == 0 else None
        if user is not None:  # what pg_ctl writes, owned by the user it runs as
            self.data_dir.mkdir(mode=0o700, exist_ok=True)
            self.log_path.touch()
            for path in (self.data_dir, self.log_path):
                os.chown(path, user.pw_uid, user.pw_gid)
        self._executor.start()
        if not self._executor.detached:
            self._start_guard()
        deadline = time.monotonic() + 30  # pg_ctl -w may return while it still starts up
        while True:
            try:
                psycopg.connect(self.dsn(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server (``pg_ctl stop -m fast``); the port and data are kept."""
        self._end_guard()
        if self.is_running():
            self._executor.stop()

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """The server's processes (postmaster and children) stopped with SIGSTOP meanwhile.

        Its kernel still accepts and acknowledges: a server that never answers. Always thawed,
        children first, then every child it has by then (a checkpointer left stopped hangs
        every later DROP DATABASE).
        """
        postmaster = self.pid
        if postmaster is None:
            raise RuntimeError("the server is not running")
        pids = [postmaster, *_children(postmaster)]
        try:
            _signal(pids, signal.SIGSTOP)
            yield
        finally:
            _signal(reversed(pids), signal.SIGCONT)
            _signal([*_children(postmaster), postmaster], signal.SIGCONT)

    def close(self) -> None:
        """Stop the server and remove a private data directory or temporary run_dir."""
        self.stop()
        if self._relocated:
            shutil.rmtree(self.data_dir.parent, ignore_errors=True)
            (self.run_dir / "state.json").unlink(missing_ok=True)
        if self._owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _start_guard(self) -> None:
        """A shell that stops the server on EOF of a pipe only this process holds."""
        self._end_guard()
        private = str(self.data_dir.parent) if self._relocated else ""
        self._guard = subprocess.Popen(  # its own session: no terminal SIGINT ends it first
            ["sh", "-c", _GUARD, str(self._pg_ctl), str(self.data_dir), private],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd="/", start_new_session=True)

    def _end_guard(self) -> None:
        if self._guard is not None:
            self._guard.kill()
            self._guard.wait()
            if self._guard.stdin is not None:
                self._guard.stdin.close()
            self._guard = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``start`` (prints the DSN), ``stop``, ``status`` (exit 0 running, 3 stopped)."""
    parser = argparse.ArgumentParser(prog="python -m devenv.postgres_server")
    parser.add_argument("command", choices=("start", "stop", "status"))
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    parser.add_argument("--database", default=DEFAULT_DATABASE)
    args = parser.parse_args(argv)
    server = PostgresServer(args.run_dir, detach=True)
    if args.command == "start":
        server.start()
        print(server.create_database(args.database))
    elif args.command == "stop":
        server.stop()
    elif server.is_running():
        print(server.dsn(args.database))
    else:
        print("stopped")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
