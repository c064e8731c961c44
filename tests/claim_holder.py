"""Another process's claim (hardcount.claims), for tests: taken on a session of its own and kept alive by
its own heartbeat until :meth:`OtherHolder.die`, after which it lapses by itself, as a killed process's does."""

from __future__ import annotations

import threading

import psycopg
from django.db import connection

TTL_S = 1.0


class OtherHolder:
    """A holder in another "process": a session of its own, a heartbeat every TTL / 4 while alive."""

    def __init__(self, key: str, holder: str = "elsewhere:1:deadbeef:1"):
        s = connection.settings_dict
        self.key, self.holder = key, holder
        self.session = psycopg.connect(
            host=s["HOST"], port=s["PORT"], user=s["USER"], dbname=s["NAME"], autocommit=True
        )
        won = self.session.execute(
            "INSERT INTO hardcount_claim (key, holder, expires_at) VALUES (%s, %s, now() + make_interval(secs => %s))"
            " ON CONFLICT (key) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at"
            " WHERE hardcount_claim.expires_at <= now() RETURNING key",
            [key, holder, TTL_S],
        ).fetchone()
        assert won, f"{key} is held already"
        self._dead = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._dead.wait(TTL_S / 4):
            self.session.execute(
                "UPDATE hardcount_claim SET expires_at = now() + make_interval(secs => %s)"
                " WHERE key = %s AND holder = %s",
                [TTL_S, self.key, self.holder],
            )

    def die(self) -> None:
        """The process is killed: no more heartbeats (the row stays until it lapses or is taken over)."""
        self._dead.set()
        self._beat.join()
        self.session.close()
