"""Fixtures for lease tests."""

from tests.leases.helpers import scratch_table  # noqa: F401 - a fixture
