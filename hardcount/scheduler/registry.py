"""Roles and services: what the scheduler runtime runs, registered by the apps that own them.

The runtime knows nothing about billing or dunning. A **role** is a singleton loop under a
leader lease (one replica at a time); a **service** is leaderless and runs in every replica
(the webhook delivery executor). Both come from settings — ``HARDCOUNT_ROLES`` and
``HARDCOUNT_SERVICES``, dotted paths of classes or objects — or from an app's
``AppConfig.ready()`` calling :func:`register_role` / :func:`register_service`.

A settings entry may also name a **role group**: an object with ``roles()``, which stands for
the roles it returns (billing's shards: one ``BillingRole`` entry is ``billing:0`` …
``billing:{n-1}``). Roles that share a ``family`` attribute are spread over the replicas
(:mod:`hardcount.scheduler.ticker`) and are selected together by the family's name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from hardcount.fencing import Fence


@dataclass
class TickContext:
    """What a role's ``tick`` receives.

    ``fence`` guards every write the tick makes (``fence.check()`` inside each write
    transaction, ``fence.alive()`` at each safe point); ``stamp()`` writes the liveness
    stamp (it takes and ignores arguments, so it can be passed as a drain's ``on_page``).
    """

    role: str
    holder: str
    token: int
    fence: Fence
    stamp: Callable[..., bool]


class TickFailed(Exception):
    """Raised by a tick that could not finish its work (e.g. a drain ended by a database error).

    Logged without a traceback, not recorded as a completed tick, and retried after
    ``min(interval, 30 s)`` instead of a full interval. Any other exception is treated the same
    way but logged with its traceback.
    """


@runtime_checkable
class Role(Protocol):
    """A singleton loop: ``name`` (the lease's role), ``interval_s`` (seconds between the end of
    one tick and the start of the next) and ``tick(ctx)``, which returns counts to log (or None).

    An optional ``family`` (a string) makes roles of the same family spread over the replicas
    (:mod:`hardcount.scheduler.ticker`); roles without one are taken by whichever replica polls first."""

    name: str

    @property
    def interval_s(self) -> float: ...

    def tick(self, ctx: TickContext) -> Mapping[str, Any] | None: ...


@runtime_checkable
class RoleGroup(Protocol):
    """A settings entry that stands for several roles: ``roles()`` returns them (each a :class:`Role`)."""

    def roles(self) -> Sequence[Role]: ...


@runtime_checkable
class Service(Protocol):
    """A leaderless background service started with the runtime in every replica."""

    name: str

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class FunctionService:
    """A :class:`Service` made of two callables (what :func:`register_service` stores)."""

    name: str
    start_fn: Callable[[], None]
    stop_fn: Callable[[], None]

    def start(self) -> None:
        self.start_fn()

    def stop(self) -> None:
        self.stop_fn()


_lock = threading.Lock()
_registered_roles: list[Role] = []
_registered_services: list[Service] = []


def register_role(role: Role) -> None:
    """Add a role to every runtime started afterwards in this process (call from ``AppConfig.ready()``)."""
    with _lock:
        if any(r.name == role.name for r in _registered_roles):
            raise ImproperlyConfigured(f"scheduler role {role.name!r} is registered twice")
        _registered_roles.append(role)


def register_service(name: str, start: Callable[[], None], stop: Callable[[], None]) -> None:
    """Add a leaderless service: ``start()`` is called when a runtime starts, ``stop()`` when it stops.

    ``start`` must return promptly (start threads, don't run the loop); ``stop`` should stop
    them and return within a few seconds. Call from ``AppConfig.ready()``.
    """
    with _lock:
        if any(s.name == name for s in _registered_services):
            raise ImproperlyConfigured(f"scheduler service {name!r} is registered twice")
        _registered_services.append(FunctionService(name, start, stop))


def _load(path: str) -> Any:
    try:
        obj = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(f"cannot import scheduler entry {path!r}: {exc}") from exc
    return obj() if isinstance(obj, type) else obj


def _expand(entry: Any) -> list[Any]:
    return list(entry.roles()) if isinstance(entry, RoleGroup) else [entry]


def configured_roles(names: Iterable[str] | None = None) -> list[Role]:
    """The roles of ``settings.HARDCOUNT_ROLES`` (groups expanded) and :func:`register_role`, optionally only ``names``.

    A name selects the role of that name, or every role of the family of that name. Raises
    ``ImproperlyConfigured`` for an entry that cannot be imported, a duplicate name, or a requested
    name no role or family has.
    """
    roles = [role for path in settings.HARDCOUNT_ROLES for role in _expand(_load(path))]
    with _lock:
        roles.extend(_registered_roles)
    seen: set[str] = set()
    for role in roles:
        if not isinstance(role, Role):
            raise ImproperlyConfigured(f"{role!r} is not a scheduler role (needs name, interval_s, tick)")
        if role.name in seen:
            raise ImproperlyConfigured(f"scheduler role {role.name!r} is configured twice")
        seen.add(role.name)
    if names is None:
        return roles
    wanted = set(names)
    families = {family for role in roles if (family := getattr(role, "family", None))}
    unknown = sorted(wanted - seen - families)
    if unknown:
        known = ", ".join(sorted(seen | families))
        raise ImproperlyConfigured(f"unknown scheduler role(s) {', '.join(unknown)}; known: {known}")
    return [role for role in roles if role.name in wanted or getattr(role, "family", None) in wanted]


def configured_services() -> list[Service]:
    """The services of ``settings.HARDCOUNT_SERVICES`` and :func:`register_service`."""
    services = [_load(path) for path in settings.HARDCOUNT_SERVICES]
    with _lock:
        services.extend(_registered_services)
    for service in services:
        if not isinstance(service, Service):
            raise ImproperlyConfigured(f"{service!r} is not a scheduler service (needs name, start, stop)")
    return services
