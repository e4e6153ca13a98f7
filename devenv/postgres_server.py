"""A throwaway, real PostgreSQL server for tests and the local demo.

The server is built from the PostgreSQL server binaries (``initdb``, ``pg_ctl``, ``postgres``) of
Debian's ``postgresql`` package; it never touches a system-wide cluster.  Binaries are looked up in
``$POSTGRES_BIN_DIR``, then ``/usr/lib/postgresql/*/bin`` (newest major version first), then on
``PATH``.

Layout of a run directory (``run_dir``)::

    run_dir/
        state.json     port and data location, so a later process (CLI ``stop``) finds the server
        postgres.log   initdb output and the server log (appended across restarts)
        data/          the cluster (PGDATA)
        socket/        the unix socket directory

The server listens on ``127.0.0.1`` only, with ``trust`` authentication for the unix socket and
loopback TCP; the superuser is ``postgres`` and has no password.  Durability settings (``fsync``,
``synchronous_commit``, ``full_page_writes``) keep PostgreSQL's defaults; extra settings can be
passed as a mapping.

``initdb`` and ``postgres`` refuse to run as root.  When the current process is root they run as
the ``postgres`` system account (created with ``useradd --system`` if missing), and the data and
socket directories are owned by that account.  If that account cannot reach ``run_dir`` (for
example below pytest's mode-0700 ``/tmp/pytest-of-root``), ``data/`` and ``socket/`` are placed in
a private directory under the system temporary directory instead; ``state.json`` records where,
and :meth:`PostgresServer.close` removes it again.

Command line::

    python -m devenv.postgres_server start  [--run-dir DIR] [--port N] [--database NAME]
    python -m devenv.postgres_server stop   [--run-dir DIR]
    python -m devenv.postgres_server status [--run-dir DIR] [--database NAME]

``start`` leaves the server running in the background (default run directory ``.run/postgres``
at the project root), creates the database (default ``user_activity``) and prints its DSN as the
last line of stdout.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import grp
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self
from urllib.parse import quote

import psycopg
from psycopg import sql
from psycopg.rows import TupleRow

__all__ = [
    "BIN_DIR_ENV",
    "DEFAULT_DATABASE",
    "DEFAULT_RUN_DIR",
    "PostgresNotFoundError",
    "PostgresServer",
    "PostgresServerError",
    "SettingValue",
    "find_bin_dir",
    "main",
]

SettingValue = str | int | float | bool
"""Type of a value in the ``settings`` mapping (``bool`` is written as ``on``/``off``)."""

BIN_DIR_ENV: Final = "POSTGRES_BIN_DIR"
"""Environment variable naming a directory holding ``initdb``, ``pg_ctl`` and ``postgres``."""

DEFAULT_RUN_DIR: Final = Path(__file__).resolve().parent.parent / ".run" / "postgres"
"""Run directory the CLI uses when ``--run-dir`` is not given."""

DEFAULT_DATABASE: Final = "user_activity"
"""Database the CLI creates when ``--database`` is not given."""

SUPERUSER: Final = "postgres"
HOST: Final = "127.0.0.1"
MAX_CONNECTIONS: Final = 200

_REQUIRED_BINARIES: Final = ("initdb", "pg_ctl", "postgres")
_DEBIAN_PREFIX: Final = Path("/usr/lib/postgresql")
_MANAGED_SETTINGS: Final = frozenset({"port", "listen_addresses", "unix_socket_directories"})
_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_CONF_NAME: Final = "devenv.conf"
_STATE_NAME: Final = "state.json"
_LOG_NAME: Final = "postgres.log"
# sun_path is 108 bytes including the terminating NUL; keep a small margin.
_MAX_SOCKET_PATH: Final = 103
_SHUTDOWN_SIGNALS: Final = {
    "smart": signal.SIGTERM,
    "fast": signal.SIGINT,
    "immediate": signal.SIGQUIT,
}
_PORT_IN_USE_MARKERS: Final = ("Address already in use", "could not create any TCP/IP sockets")


class PostgresServerError(RuntimeError):
    """The throwaway PostgreSQL server could not be started, stopped or used."""


class PostgresNotFoundError(PostgresServerError):
    """No PostgreSQL server binaries were found on this machine."""


class _PortInUseError(PostgresServerError):
    """The postmaster exited because its TCP port was taken."""


def _version_key(path: Path) -> tuple[int, ...]:
    """Sort key for ``/usr/lib/postgresql/<version>/bin`` (non-numeric versions sort last)."""
    try:
        return tuple(int(part) for part in path.parent.name.split("."))
    except ValueError:
        return (-1,)


def _has_binaries(directory: Path) -> bool:
    """Whether ``directory`` holds executable ``initdb``, ``pg_ctl`` and ``postgres``."""
    return all(os.access(directory / name, os.X_OK) for name in _REQUIRED_BINARIES)


def find_bin_dir(preferred: str | os.PathLike[str] | None = None) -> Path:
    """Return the directory holding the PostgreSQL server binaries.

    Lookup order: ``preferred`` (if given, it is the only candidate), ``$POSTGRES_BIN_DIR`` (if
    set, likewise), ``/usr/lib/postgresql/*/bin`` newest major version first, then the
    directories of ``pg_ctl``/``postgres``/``initdb`` found on ``PATH``.

    Raises:
        PostgresNotFoundError: if no directory holds all of ``initdb``, ``pg_ctl`` and
            ``postgres``.
    """
    explicit = preferred if preferred is not None else os.environ.get(BIN_DIR_ENV) or None
    if explicit is not None:
        directory = Path(explicit)
        if _has_binaries(directory):
            return directory
        raise PostgresNotFoundError(
            f"{directory} does not contain executable {', '.join(_REQUIRED_BINARIES)}"
        )
    candidates = sorted(_DEBIAN_PREFIX.glob("*/bin"), key=_version_key, reverse=True)
    for name in _REQUIRED_BINARIES:
        found = shutil.which(name)
        if found is not None:
            candidates.append(Path(found).resolve().parent)
    for directory in candidates:
        if _has_binaries(directory):
            return directory
    raise PostgresNotFoundError(
        "No PostgreSQL server binaries (initdb, pg_ctl, postgres) found in "
        f"${BIN_DIR_ENV}, {_DEBIAN_PREFIX}/*/bin or on PATH. "
        "Install them with `apt-get install -y postgresql` (Debian/Ubuntu) "
        f"or point ${BIN_DIR_ENV} at their directory."
    )


def _free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_available(port: int) -> bool:
    """Whether a listening socket could bind 127.0.0.1:``port`` (as the postmaster does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie.

    A detached postmaster is re-parented to PID 1, which may reap it late (or never, in some
    containers); a zombie must count as stopped.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # Format: "pid (comm) state ..."; comm may contain spaces or parentheses.
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _format_setting(name: str, value: SettingValue) -> str:
    """Render one ``name = value`` line of a postgresql.conf file."""
    if not _SETTING_NAME.match(name):
        raise ValueError(f"invalid PostgreSQL setting name: {name!r}")
    if isinstance(value, bool):
        rendered = "on" if value else "off"
    elif isinstance(value, int | float):
        rendered = str(value)
    else:
        rendered = "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"
    return f"{name} = {rendered}"


def _ensure_system_user(name: str) -> pwd.struct_passwd:
    """Return the passwd entry of ``name``, creating it as a system user if it is missing."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        raise PostgresServerError(
            f"running as root, the system user {name!r} is missing and useradd is not available"
        )
    try:
        grp.getgrnam(name)
        group_args = ["--gid", name]
    except KeyError:
        group_args = ["--user-group"]
    cmd = [
        useradd,
        "--system",
        *group_args,
        "--home-dir",
        "/var/lib/postgresql",
        "--no-create-home",
        "--shell",
        "/usr/sbin/nologin",
        name,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise PostgresServerError(
            f"could not create system user {name!r}: {result.stderr.strip() or result.stdout}"
        )
    return pwd.getpwnam(name)


_RUNNING: set[PostgresServer] = set()


@atexit.register
def _stop_leftover_servers() -> None:
    """Stop servers this process started (non-detached) and never stopped."""
    for server in list(_RUNNING):
        with contextlib.suppress(Exception):
            server.close()


class PostgresServer:
    """A throwaway PostgreSQL cluster listening on 127.0.0.1.

    Typical test use::

        with PostgresServer(tmp_path / "pg") as server:
            dsn = server.create_database("user_activity")
            ...
            server.stop()    # e.g. a chaos test: Postgres is down
            server.start()   # same port, same data

    Args:
        run_dir: directory for state, log, data and socket; created if missing.  ``None`` makes a
            fresh temporary directory that :meth:`close` removes.
        port: TCP port; ``None`` reuses the port recorded in ``run_dir`` or picks a free one.
        settings: extra server settings (``postgresql.conf`` names), applied on every start;
            ``port``, ``listen_addresses`` and ``unix_socket_directories`` are managed here.
        bin_dir: directory of the server binaries; see :func:`find_bin_dir`.
        detach: start the server in its own session so it outlives this Python process (the
            CLI uses this); otherwise it is stopped at interpreter exit if still running.
        startup_timeout: seconds to wait for the server to accept connections.
        stop_timeout: seconds ``pg_ctl stop -m fast`` may take before ``-m immediate``.
        system_user: account that runs ``initdb``/``postgres`` when this process is root.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        settings: Mapping[str, SettingValue] | None = None,
        bin_dir: str | os.PathLike[str] | None = None,
        detach: bool = False,
        startup_timeout: float = 60.0,
        stop_timeout: float = 30.0,
        system_user: str = "postgres",
    ) -> None:
        self._settings: dict[str, SettingValue] = dict(settings or {})
        for name in self._settings:
            _format_setting(name, self._settings[name])
            if name.lower() in _MANAGED_SETTINGS:
                raise ValueError(f"setting {name!r} is managed by PostgresServer")
        self._bin_dir = find_bin_dir(bin_dir)
        self._owns_run_dir = run_dir is None
        if run_dir is None:
            self._run_dir = Path(tempfile.mkdtemp(prefix="devenv-postgres-"))
            if os.geteuid() == 0:
                self._run_dir.chmod(0o711)  # let the postgres account traverse it
        else:
            self._run_dir = Path(run_dir).absolute()
        self._detach = detach
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._system_user = system_user
        self._proc: subprocess.Popen[bytes] | None = None
        self._base_dir: Path | None = None
        self._relocated = False
        self._port_is_auto = port is None
        self._port: int | None = port
        self._state_port: int | None = None  # port recorded by the last start of this run_dir
        self._load_state()

    # ------------------------------------------------------------------ properties

    @property
    def run_dir(self) -> Path:
        """Directory holding ``state.json`` and ``postgres.log`` (and usually the data)."""
        return self._run_dir

    @property
    def bin_dir(self) -> Path:
        """Directory of the PostgreSQL server binaries in use."""
        return self._bin_dir

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (final once :meth:`start` has run)."""
        return (self._base_dir or self._run_dir) / "data"

    @property
    def socket_dir(self) -> Path | None:
        """Unix socket directory, or ``None`` if its path would be too long for a socket."""
        directory = (self._base_dir or self._run_dir) / "socket"
        probe = directory / f".s.PGSQL.{self._port or 65535}"
        return directory if len(os.fsencode(probe)) <= _MAX_SOCKET_PATH else None

    @property
    def log_path(self) -> Path:
        """File receiving ``initdb`` output and the server log."""
        return self._run_dir / _LOG_NAME

    @property
    def port(self) -> int:
        """TCP port on 127.0.0.1 (known after :meth:`start`, or when given/recorded)."""
        if self._port is None:
            raise PostgresServerError("the server has no port yet; call start() first")
        return self._port

    @property
    def pid(self) -> int | None:
        """PID of the running postmaster, or ``None`` if it is not running."""
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None  # reaped: a crashed child must not look alive as a zombie
        try:
            first_line = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            pid = int(first_line)
        except (OSError, ValueError):
            # No pid file (still starting, or the data directory was removed under us): a
            # postmaster started by this object is still ours to report and stop.
            return None if self._proc is None else self._proc.pid
        return pid if _process_alive(pid) else None

    def is_running(self) -> bool:
        """Whether the postmaster of this data directory is alive."""
        return self.pid is not None

    # ------------------------------------------------------------------ DSNs and SQL

    def dsn(self, dbname: str = "postgres") -> str:
        """Return ``postgresql://postgres@127.0.0.1:PORT/DBNAME``."""
        return f"postgresql://{SUPERUSER}@{HOST}:{self.port}/{quote(dbname, safe='')}"

    def connect(self, dbname: str = "postgres", **kwargs: Any) -> psycopg.Connection[TupleRow]:
        """Open a psycopg connection to ``dbname`` as the superuser."""
        return psycopg.connect(self.dsn(dbname), **kwargs)

    def create_database(self, name: str, *, exist_ok: bool = True) -> str:
        """Create database ``name`` (owned by ``postgres``) and return its DSN.

        Raises:
            PostgresServerError: if it exists and ``exist_ok`` is false.
        """
        with self.connect(autocommit=True) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
            ).fetchone()
            if exists is not None:
                if not exist_ok:
                    raise PostgresServerError(f"database {name!r} already exists")
            else:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn(name)

    def drop_database(self, name: str, *, missing_ok: bool = True) -> None:
        """Drop database ``name``, disconnecting its sessions (``WITH (FORCE)``)."""
        statement = sql.SQL("DROP DATABASE {}{} WITH (FORCE)").format(
            sql.SQL("IF EXISTS ") if missing_ok else sql.SQL(""), sql.Identifier(name)
        )
        with self.connect(autocommit=True) as conn:
            conn.execute(statement)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Initialise the cluster if needed, start it and wait until it accepts connections.

        Restarting after :meth:`stop` reuses the same port and data directory.  If the server of
        this data directory is already running, this only waits for it to be ready.

        Raises:
            PostgresServerError: on any failure; the message includes the tail of the log.
        """
        if self.is_running():
            running_port = self._state_port
            if running_port is None:
                raise PostgresServerError(
                    f"a postmaster is running on {self.data_dir} but its port is unknown"
                )
            if self._port is not None and self._port != running_port:
                raise PostgresServerError(
                    f"the server of {self.data_dir} is already running on port {running_port}; "
                    "stop it before changing the port"
                )
            self._port = running_port
            self._wait_ready(log_offset=None)
            return
        self._prepare_dirs()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        self._check_data_version()
        attempts = 5 if self._port_is_auto else 1
        for attempt in range(attempts):
            if self._port is None:
                self._port = _free_port()
            if not _port_available(self._port):
                if self._port_is_auto and attempt + 1 < attempts:
                    self._port = None
                    continue
                raise PostgresServerError(
                    f"port {self._port} on {HOST} is already in use (Address already in use)"
                )
            self._write_config()
            log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._launch()
            try:
                self._wait_ready(log_offset=log_offset)
            except _PortInUseError:
                if attempt + 1 >= attempts:
                    raise
                self._port = None
                continue
            break
        self._port_is_auto = False  # restarts must come back on the same port
        self._state_port = self._port
        self._save_state()

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``pg_ctl stop -m MODE``); no-op if it is not running.

        ``mode`` is ``"smart"``, ``"fast"`` (default) or ``"immediate"`` (crash-like: the next
        start runs recovery).  If the shutdown does not finish within ``stop_timeout`` seconds it
        is escalated to ``immediate``, and finally to SIGKILL.  If ``pg_ctl`` cannot act (e.g.
        ``postmaster.pid`` is gone), the same shutdown signals are sent to the postmaster directly.
        """
        if mode not in _SHUTDOWN_SIGNALS:
            raise ValueError(f"unknown shutdown mode {mode!r}")
        pid = self.pid
        if pid is not None:
            result = self._pg_ctl_stop(mode, self._stop_timeout)
            if _process_alive(pid) and not (self.data_dir / "postmaster.pid").exists():
                self._signal(pid, _SHUTDOWN_SIGNALS[mode])
                self._wait_exit(pid, timeout=self._stop_timeout)
            if _process_alive(pid) and mode != "immediate":
                result = self._pg_ctl_stop("immediate", 10.0)
                if _process_alive(pid):
                    self._signal(pid, signal.SIGQUIT)
                    self._wait_exit(pid, timeout=10.0)
            if _process_alive(pid):
                self._signal(pid, signal.SIGKILL)
            self._wait_exit(pid, timeout=10.0)
            if _process_alive(pid):
                raise PostgresServerError(
                    f"could not stop postmaster {pid}: {result.stdout}{result.stderr}"
                )
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10.0)
            self._proc = None
        _RUNNING.discard(self)

    def restart(self, mode: str = "fast") -> None:
        """Stop (with ``mode``) and start again on the same port and data directory."""
        self.stop(mode)
        self.start()

    def remove_data(self) -> None:
        """Stop the server and delete its data, socket directory and ``state.json``.

        A temporary run directory (``run_dir=None``) is removed entirely; a caller-supplied one
        keeps ``postgres.log``.
        """
        self.stop()
        if self._relocated and self._base_dir is not None:
            shutil.rmtree(self._base_dir, ignore_errors=True)
        else:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            shutil.rmtree((self._base_dir or self._run_dir) / "socket", ignore_errors=True)
        (self._run_dir / _STATE_NAME).unlink(missing_ok=True)
        if self._owns_run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        self._base_dir = None
        self._relocated = False

    def close(self) -> None:
        """Stop the server and remove what this object created outside a caller's run_dir.

        That is the temporary run directory (``run_dir=None``) or the private directory used when
        the ``postgres`` account could not reach ``run_dir``.  Data inside a caller-supplied
        ``run_dir`` is kept.
        """
        self.stop()
        if self._owns_run_dir or self._relocated:
            self.remove_data()

    def __enter__(self) -> Self:
        """Start the server (if not running) and return it."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server; see :meth:`close`."""
        self.close()

    def __repr__(self) -> str:
        """Return a short description with the run directory and port."""
        return f"PostgresServer(run_dir={str(self._run_dir)!r}, port={self._port})"

    # ------------------------------------------------------------------ internals

    def _binary(self, name: str) -> str:
        return str(self._bin_dir / name)

    def _user(self) -> pwd.struct_passwd | None:
        """Return the account to run PostgreSQL as, or ``None`` for the current user."""
        if os.geteuid() != 0:
            return None
        return _ensure_system_user(self._system_user)

    def _run_as(
        self, cmd: Sequence[str], *, timeout: float, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        user = self._user()
        return subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=cwd or self._cwd(),
            env=self._env(user),
            user=None if user is None else user.pw_uid,
            group=None if user is None else user.pw_gid,
            extra_groups=None if user is None else self._groups(user),
        )

    @staticmethod
    def _groups(user: pwd.struct_passwd) -> list[int]:
        return os.getgrouplist(user.pw_name, user.pw_gid)

    @staticmethod
    def _env(user: pwd.struct_passwd | None) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
        env.setdefault("LC_ALL", "C.UTF-8")
        if user is not None:
            env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
        return env

    def _cwd(self) -> Path:
        base = self._base_dir or self._run_dir
        return base if base.is_dir() else Path("/")

    def _chown(self, path: Path, user: pwd.struct_passwd | None) -> None:
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)

    def _user_can_traverse(self, path: Path, user: pwd.struct_passwd) -> bool:
        result = subprocess.run(
            ["test", "-x", str(path)],
            check=False,
            cwd="/",
            user=user.pw_uid,
            group=user.pw_gid,
            extra_groups=self._groups(user),
        )
        return result.returncode == 0

    def _prepare_dirs(self) -> None:
        self._run_dir.mkdir(parents=True, exist_ok=True)
        user = self._user()
        if self._base_dir is None or not self._base_dir.is_dir():
            self._base_dir = self._run_dir
            self._relocated = False
            if user is not None and not self._user_can_traverse(self._run_dir, user):
                self._base_dir = Path(tempfile.mkdtemp(prefix="devenv-pgdata-"))
                self._relocated = True
                self._chown(self._base_dir, user)
        for directory, mode in ((self.data_dir, 0o700), (self._base_dir / "socket", 0o755)):
            if not directory.exists():
                directory.mkdir(mode=mode)
                self._chown(directory, user)
                directory.chmod(mode)

    def _initdb(self) -> None:
        cmd = [
            self._binary("initdb"),
            "--pgdata",
            str(self.data_dir),
            "--username",
            SUPERUSER,
            "--encoding",
            "UTF8",
            "--locale",
            "C",
            "--auth",
            "trust",
            "--no-instructions",
        ]
        result = self._run_as(cmd, timeout=300.0)
        with self.log_path.open("a") as log:
            log.write(f"--- initdb {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            log.write(result.stdout + result.stderr)
        if result.returncode != 0:
            raise PostgresServerError(
                f"initdb failed (exit {result.returncode}):\n{result.stdout}{result.stderr}"
            )
        (self.data_dir / "pg_hba.conf").write_text(
            "# written by devenv.postgres_server: trust on the socket and loopback only\n"
            "local all all trust\n"
            f"host all all {HOST}/32 trust\n"
            "local replication all trust\n"
            f"host replication all {HOST}/32 trust\n"
        )
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(f"\ninclude_if_exists = '{_CONF_NAME}'\n")

    def _server_version(self) -> str:
        result = subprocess.run(
            [self._binary("postgres"), "--version"],
            capture_output=True,
            text=True,
            check=False,
        )
        match = re.search(r"\(PostgreSQL\) (\d+)", result.stdout)
        if match is None:
            raise PostgresServerError(f"cannot parse `postgres --version`: {result.stdout!r}")
        return match.group(1)

    def _check_data_version(self) -> None:
        data_version = (self.data_dir / "PG_VERSION").read_text().strip()
        binary_version = self._server_version()
        if data_version != binary_version:
            raise PostgresServerError(
                f"{self.data_dir} was created by PostgreSQL {data_version} but the binaries in "
                f"{self._bin_dir} are version {binary_version}; remove the directory or set "
                f"${BIN_DIR_ENV}"
            )

    def _write_config(self) -> None:
        socket_dir = self.socket_dir
        lines = [
            "# written by devenv.postgres_server on every start; do not edit",
            _format_setting("listen_addresses", HOST),
            _format_setting("port", self.port),
            _format_setting("unix_socket_directories", str(socket_dir) if socket_dir else ""),
            _format_setting("max_connections", MAX_CONNECTIONS),
            _format_setting("log_line_prefix", "%m [%p] %q%u@%d "),
        ]
        lines += [_format_setting(name, value) for name, value in self._settings.items()]
        path = self.data_dir / _CONF_NAME
        path.write_text("\n".join(lines) + "\n")
        self._chown(path, self._user())

    def _launch(self) -> None:
        user = self._user()
        with self.log_path.open("ab") as log:
            log.write(f"--- postgres start {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                [self._binary("postgres"), "-D", str(self.data_dir)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._cwd(),
                env=self._env(user),
                start_new_session=self._detach,
                user=None if user is None else user.pw_uid,
                group=None if user is None else user.pw_gid,
                extra_groups=None if user is None else self._groups(user),
            )
        if not self._detach:
            _RUNNING.add(self)

    def _log_tail(self, offset: int | None, lines: int = 30) -> str:
        try:
            with self.log_path.open("rb") as log:
                if offset is not None:
                    log.seek(offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait_ready(self, log_offset: int | None) -> None:
        deadline = time.monotonic() + self._startup_timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                _RUNNING.discard(self)
                tail = self._log_tail(log_offset)
                error_type = (
                    _PortInUseError
                    if any(marker in tail for marker in _PORT_IN_USE_MARKERS)
                    else PostgresServerError
                )
                raise error_type(
                    f"postgres exited with code {code} during startup; log {self.log_path}:\n{tail}"
                )
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as exc:
                last_error = exc
            time.sleep(0.05)
        raise PostgresServerError(
            f"postgres did not accept connections on port {self._port} within "
            f"{self._startup_timeout:.0f}s ({last_error}); log {self.log_path}:\n"
            f"{self._log_tail(log_offset)}"
        )

    def _pg_ctl_stop(self, mode: str, timeout: float) -> subprocess.CompletedProcess[str]:
        cmd = [
            self._binary("pg_ctl"),
            "stop",
            "--pgdata",
            str(self.data_dir),
            "--mode",
            mode,
            "--wait",
            "--timeout",
            str(max(1, round(timeout))),
        ]
        try:
            return self._run_as(cmd, timeout=timeout + 15.0)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(cmd, -1, str(exc.stdout or ""), "pg_ctl timed out")

    @staticmethod
    def _signal(pid: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    def _wait_exit(self, pid: int, timeout: float) -> None:
        if self._proc is not None and self._proc.pid == pid:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=timeout)
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _process_alive(pid):
            time.sleep(0.02)

    def _load_state(self) -> None:
        try:
            state = json.loads((self._run_dir / _STATE_NAME).read_text())
        except (OSError, ValueError):
            return
        base = state.get("base_dir")
        if isinstance(base, str) and Path(base).is_dir():
            self._base_dir = Path(base)
            self._relocated = bool(state.get("relocated", False))
        stored_port = state.get("port")
        if isinstance(stored_port, int):
            self._state_port = stored_port
            if self._port is None:
                self._port = stored_port
                self._port_is_auto = False

    def _save_state(self) -> None:
        state = {
            "port": self._port,
            "base_dir": str(self._base_dir or self._run_dir),
            "relocated": self._relocated,
            "data_dir": str(self.data_dir),
            "bin_dir": str(self._bin_dir),
            "pid": self.pid,
            "log": str(self.log_path),
        }
        (self._run_dir / _STATE_NAME).write_text(json.dumps(state, indent=2) + "\n")


# ---------------------------------------------------------------------- CLI


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devenv.postgres_server",
        description="Run a throwaway PostgreSQL server for the local demo and tests.",
    )
    parser.add_argument("command", choices=("start", "stop", "status"))
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=DEFAULT_RUN_DIR,
        help=f"state/data/log directory (default: {DEFAULT_RUN_DIR})",
    )
    parser.add_argument(
        "--port", type=int, default=None, help="TCP port (default: recorded or free port)"
    )
    parser.add_argument(
        "--database",
        default=DEFAULT_DATABASE,
        help=f"database to create and print the DSN of (default: {DEFAULT_DATABASE})",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the process exit code (``status``: 0 running, 3 stopped)."""
    args = _parse_args(argv)
    try:
        server = PostgresServer(args.run_dir, port=args.port, detach=True)
        if args.command == "start":
            pid = server.pid
            started = time.monotonic()
            server.start()
            dsn = server.create_database(args.database)
            verb = "already running" if pid is not None else "started"
            print(
                f"postgres {verb}: pid {server.pid}, port {server.port}, data {server.data_dir}, "
                f"log {server.log_path} ({time.monotonic() - started:.1f}s)",
                file=sys.stderr,
            )
            print(dsn, flush=True)
            return 0
        if args.command == "stop":
            pid = server.pid
            if pid is None:
                print("postgres is not running", file=sys.stderr)
                return 0
            server.stop()
            print(f"postgres stopped (pid {pid})", file=sys.stderr)
            return 0
        pid = server.pid
        if pid is None:
            print("stopped")
            return 3
        print(f"running: pid {pid}, port {server.port}, data {server.data_dir}")
        print(server.dsn(args.database))
        return 0
    except PostgresServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
