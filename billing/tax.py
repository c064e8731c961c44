"""Tax: a provider interface, and the default table-rate provider.

The close asks the configured provider (``settings.HARDCOUNT_TAX_PROVIDER``, a dotted path to a
class taking no arguments) for the tax on an invoice's subtotal. A provider that cannot answer
raises :class:`TaxUnavailable`: the invoice then waits as a draft with ``tax_status=pending``,
the subscription's period advances, and the billing tick's reconciler finalises and charges the
invoice when the provider answers again (docs/reference/billing.md#tax-pending).

Tax is computed on the subtotal (the sum of the lines) less the invoice's discounts, as Stripe taxes the
discounted amount; the customer's credit balance is applied after tax, to the total, as Stripe applies a
customer balance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Protocol

from django.conf import settings
from django.utils.module_loading import import_string


class TaxUnavailable(Exception):
    """The provider cannot compute tax now (outage, timeout); try again later."""


@dataclass(frozen=True)
class TaxQuote:
    """``amount`` minor units of the invoice currency at ``rate_bps`` basis points (1 bp = 0.01 %).

    ``applicable`` False means no tax applies (the invoice's ``tax_status`` is ``not_applicable``).
    """

    rate_bps: int
    amount: int
    applicable: bool


@dataclass(frozen=True)
class TaxableInvoice:
    """What a provider sees: the tenant, mode and customer, and ``subtotal`` minor units of ``currency``: the
    invoice's amount after discounts (docs/reference/discounts.md), before tax and the customer's balance."""

    tenant_id: str
    livemode: bool
    customer_id: str
    currency: str
    subtotal: int


class TaxProvider(Protocol):
    """Computes the tax on one invoice. Must be thread-safe; raises :class:`TaxUnavailable`."""

    def calculate(self, invoice: TaxableInvoice) -> TaxQuote: ...


def tax_on(amount: int, rate_bps: int) -> int:
    """``amount × rate_bps / 10 000`` rounded half up to a whole minor unit (exact integer arithmetic).

    ``tax_on(1005, 1000) == 101`` (100.5 rounds up); ``tax_on(1004, 1000) == 100``. Amounts are
    never negative here (subtotals are ≥ 0).
    """
    if amount < 0 or rate_bps < 0:
        raise ValueError("amount and rate must be non-negative")
    return (amount * rate_bps + 5_000) // 10_000


def _parse_rates(raw: str) -> dict[str, int]:
    rates: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        currency, _, bps = item.partition(":")
        rates[currency.strip().lower()] = int(bps)
    return rates


class TableRateTaxProvider:
    """One rate per currency, in basis points: ``settings.HARDCOUNT_TAX_RATES_BPS`` (a dict such as
    ``{"eur": 2000}``) or the environment variable of that name (``"eur:2000,gbp:2000"``).

    A currency without a rate (the default: none configured) is not taxed. Rounding: half up to
    the minor unit (:func:`tax_on`). Never unavailable.
    """

    def calculate(self, invoice: TaxableInvoice) -> TaxQuote:
        rates = getattr(settings, "HARDCOUNT_TAX_RATES_BPS", None)
        if rates is None:
            rates = _parse_rates(os.environ.get("HARDCOUNT_TAX_RATES_BPS", ""))
        rate = int(rates.get(invoice.currency, 0))
        if rate <= 0:
            return TaxQuote(rate_bps=0, amount=0, applicable=False)
        return TaxQuote(rate_bps=rate, amount=tax_on(invoice.subtotal, rate), applicable=True)


@cache
def _provider(path: str) -> TaxProvider:
    return import_string(path)()


def get_tax_provider() -> TaxProvider:
    """The provider named by ``settings.HARDCOUNT_TAX_PROVIDER`` (one instance per path)."""
    return _provider(settings.HARDCOUNT_TAX_PROVIDER)
