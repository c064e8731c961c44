"""The scheduler runtime: ticker threads per role under leader leases. Knows nothing about billing."""
