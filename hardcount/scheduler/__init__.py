"""The scheduler runtime: ticker threads per role under leader leases. Knows nothing about billing.

Roles (singleton loops, one replica at a time) and services (leaderless, every replica)
are registered by their apps — see :mod:`hardcount.scheduler.registry` — and run by a
:class:`~hardcount.scheduler.runtime.Runtime`.
"""

from hardcount.scheduler.registry import (
    Role,
    Service,
    TickContext,
    TickFailed,
    configured_roles,
    configured_services,
    register_role,
    register_service,
)
from hardcount.scheduler.runtime import Runtime, process_leadership, start_process_runtime, stop_process_runtime

__all__ = [
    "Role",
    "Runtime",
    "Service",
    "TickContext",
    "TickFailed",
    "configured_roles",
    "configured_services",
    "process_leadership",
    "register_role",
    "register_service",
    "start_process_runtime",
    "stop_process_runtime",
]
