"""The tests' gateway proxy is the strict dev Stripe that ``make run`` uses: :mod:`devstack.strict_stripe`.

Kept so existing imports (``from tests.stripe_proxy import StripeProxy``) and the documents that name
this file keep working; the fault API, the log and the idempotency layer are described there.
"""

from devstack.strict_stripe import FAULT_KINDS, LogEntry, ProxyRequest, StrictStripe

StripeProxy = StrictStripe

__all__ = ["FAULT_KINDS", "LogEntry", "ProxyRequest", "StrictStripe", "StripeProxy"]
