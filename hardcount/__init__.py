"""Hardcount: subscription billing on Django and PostgreSQL (cross-cutting project package)."""
