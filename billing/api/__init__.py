"""Billing's HTTP API, one module per resource group (``catalog``, ``runs``, ...).

Views follow ``docs/api-conventions.md``; their URL patterns are in :mod:`billing.urls`.
"""
