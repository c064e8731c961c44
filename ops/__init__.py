"""ops: read-only observers of every app — the money-invariant doctor and the admin dashboard.

The top layer with devstack (docs/decisions/0121-kernel-ops-and-devstack.md): it may read any
app; no app imports it.
"""
