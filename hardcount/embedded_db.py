"""The embedded PostgreSQL used when no ``DATABASE_URL`` is set.

With no ``DATABASE_URL`` the service and the tests start (or reuse) a real PostgreSQL
from the ``pgserver`` package, with its data under ``var/pgdata``. The server is left
running when the process exits so the next command reuses it; ``make stop-db`` stops it.
SQLite is never an option: the design depends on ``FOR UPDATE SKIP LOCKED``, partial
unique indexes and the database's ``now()``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

logging.getLogger("pgserver").setLevel(logging.WARNING)

DATABASE_NAME = "hardcount"

# Settings the embedded server needs beyond initdb's defaults: the test suite and the
# scheduler open a connection per thread, and several replicas may run at once.
_SERVER_SETTINGS = {"max_connections": "400"}


def embedded_connection(data_dir: Path) -> dict[str, str]:
    """Start (or reuse) the embedded server in ``data_dir`` and return connection parts.

    Returns a dict with ``host`` (the Unix socket directory), ``port``, ``user`` and
    ``name``; the ``hardcount`` database is created on first use.
    """
    os.environ.setdefault("XDG_RUNTIME_DIR", str(data_dir.parent / "run"))
    Path(os.environ["XDG_RUNTIME_DIR"]).mkdir(parents=True, exist_ok=True, mode=0o700)
    import pgserver  # imported late: only the embedded path needs it
    from pgserver import postgres_server

    # pgserver's own fallback for a too-long socket path lies under the runtime dir (beside the
    # data, so just as long) and loosens that dir's mode: choose the socket directory ourselves.
    postgres_server.find_suitable_socket_dir = lambda pgdata, runtime_path: _socket_dir(pgdata)

    data_dir.parent.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(data_dir, cleanup_mode=None)
    if _apply_server_settings(server):
        server = _restart(server, data_dir)
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")
    if "(1 row)" not in exists:
        server.psql(f"CREATE DATABASE {DATABASE_NAME};")
    info = server.get_postmaster_info()
    return {
        "host": str(info.socket_dir) if info.socket_dir else "127.0.0.1",
        "port": str(info.port or 5432),
        "user": "postgres",
        "name": DATABASE_NAME,
    }


# A Unix socket path holds at most 107 bytes on Linux (sun_path is 108 with its NUL).
_MAX_SOCKET_PATH = 107


def _socket_dir(data_dir: Path) -> Path:
    """The directory for the server's Unix socket, created if missing.

    ``data_dir`` itself when ``<data_dir>/.s.PGSQL.5432`` fits in a socket path; for a clone
    so deep that it does not, a short directory in the system temp dir, named by a hash of
    ``data_dir`` so two clones never share one.
    """
    data_dir = data_dir.expanduser().resolve()
    if len(os.fsencode(data_dir / ".s.PGSQL.5432")) <= _MAX_SOCKET_PATH:
        return data_dir
    digest = hashlib.sha256(os.fsencode(data_dir)).hexdigest()[:12]
    socket_dir = Path(tempfile.gettempdir()) / f"hardcount-{digest}"
    socket_dir.mkdir(exist_ok=True)
    return socket_dir


def _apply_server_settings(server) -> bool:
    """Write missing server settings with ALTER SYSTEM; True when a restart is needed."""
    changed = False
    for name, value in _SERVER_SETTINGS.items():
        current = server.psql(f"SHOW {name};")
        if value not in current:
            server.psql(f"ALTER SYSTEM SET {name} = '{value}';")
            changed = True
    return changed


def _restart(server, data_dir: Path):
    import pgserver
    from pgserver._commands import pg_ctl

    pg_ctl(["-w", "stop"], pgdata=data_dir, user=server.system_user)
    pgserver.PostgresServer._instances.pop(data_dir.resolve(), None)
    return pgserver.get_server(data_dir, cleanup_mode=None)
