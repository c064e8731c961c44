"""Billing's business operations, one module per concern.

Other apps call billing only through this package (an import-linter contract checks it).
Import from the submodules: ``billing.services.catalog`` (customers, prices,
subscriptions), ``billing.services.drain`` (the billing drain), and so on.
"""
