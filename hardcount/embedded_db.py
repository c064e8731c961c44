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
    os.environ.setdefault("XDG_RUNTIME_DIR", str(_runtime_dir(data_dir)))
    Path(os.environ["XDG_RUNTIME_DIR"]).mkdir(parents=True, exist_ok=True, mode=0o700)
    import pgserver  # imported late: only the embedded path needs it

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


def _runtime_dir(data_dir: Path) -> Path:
    """The runtime directory pgserver uses for its lock file and its fallback socket directory.

    pgserver puts the socket in ``data_dir`` when that path is short enough, else in
    ``<runtime>/python_PostgresServer/<10 hex>/``. That is ``var/run`` beside the data, unless
    the clone sits so deep that even this path is too long for a socket: then a short
    directory in the system temp dir, named by a hash of ``data_dir`` so two clones never share it.
    """
    data_dir = data_dir.expanduser().resolve()
    preferred = data_dir.parent / "run"
    fallback_socket = preferred / "python_PostgresServer" / ("0" * 10) / ".s.PGSQL.5432"
    if len(os.fsencode(fallback_socket)) <= _MAX_SOCKET_PATH:
        return preferred
    digest = hashlib.sha256(os.fsencode(data_dir)).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"hardcount-{digest}"


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
