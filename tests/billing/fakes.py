"""Test doubles for the tax provider interface (the gateway's faults go through tests.stripe_proxy)."""

from billing.tax import TaxQuote, TaxUnavailable


class DownTaxProvider:
    """A provider in an outage: every call raises TaxUnavailable."""

    def calculate(self, invoice):
        raise TaxUnavailable("tax service unreachable (test)")


class TenPercentTaxProvider:
    """10 % on everything, rounded half up."""

    def calculate(self, invoice):
        return TaxQuote(rate_bps=1000, amount=(invoice.subtotal * 1000 + 5000) // 10000, applicable=True)
