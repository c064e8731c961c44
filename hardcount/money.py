"""Currencies and minor units.

Amounts are always integer minor units together with a lower-case ISO 4217 code: 1000
``usd`` is $10.00, 1000 ``jpy`` is ¥1,000 (the yen has no minor unit). The exponents are
ISO 4217's; the minimum charge amounts are Stripe's documented minimums
(https://docs.stripe.com/currencies#minimum-and-maximum-charge-amounts): an amount due
under the minimum is not charged but carried to the customer's balance.
"""

from __future__ import annotations

from decimal import Decimal

from babel.numbers import format_currency, get_currency_precision, is_currency

# ISO 4217 minor-unit exponents for the currencies Hardcount accepts.
CURRENCY_EXPONENTS: dict[str, int] = {
    "aed": 2,
    "aud": 2,
    "bgn": 2,
    "bhd": 3,
    "brl": 2,
    "cad": 2,
    "chf": 2,
    "clp": 0,
    "cny": 2,
    "czk": 2,
    "dkk": 2,
    "eur": 2,
    "gbp": 2,
    "hkd": 2,
    "huf": 2,
    "idr": 2,
    "ils": 2,
    "inr": 2,
    "isk": 0,
    "jod": 3,
    "jpy": 0,
    "krw": 0,
    "kwd": 3,
    "mxn": 2,
    "myr": 2,
    "nok": 2,
    "nzd": 2,
    "omr": 3,
    "php": 2,
    "pln": 2,
    "ron": 2,
    "sek": 2,
    "sgd": 2,
    "thb": 2,
    "try": 2,
    "twd": 2,
    "ugx": 0,
    "usd": 2,
    "vnd": 0,
    "xof": 0,
    "zar": 2,
}

# Stripe's minimum charge per currency, in that currency's minor units.
MINIMUM_CHARGE: dict[str, int] = {
    "usd": 50,
    "aed": 200,
    "aud": 50,
    "bgn": 100,
    "brl": 50,
    "cad": 50,
    "chf": 50,
    "czk": 1500,
    "dkk": 250,
    "eur": 50,
    "gbp": 30,
    "hkd": 400,
    "huf": 17500,
    "inr": 50,
    "jpy": 50,
    "mxn": 1000,
    "myr": 200,
    "nok": 300,
    "nzd": 50,
    "pln": 200,
    "ron": 200,
    "sek": 300,
    "sgd": 50,
    "thb": 1000,
}

# Largest amount accepted anywhere in the API: Stripe's 8-digit ceiling on amounts.
MAX_AMOUNT = 99_999_999


class UnknownCurrency(ValueError):
    """Raised for a currency code Hardcount does not accept."""


def normalize_currency(code: str) -> str:
    """Return the lower-case code, or raise :class:`UnknownCurrency`."""
    if not isinstance(code, str) or code.lower() not in CURRENCY_EXPONENTS:
        raise UnknownCurrency(f"unknown or unsupported currency: {code!r}")
    return code.lower()


def exponent(currency: str) -> int:
    """Minor-unit exponent of ``currency`` (2 for usd, 0 for jpy, 3 for kwd)."""
    return CURRENCY_EXPONENTS[normalize_currency(currency)]


def minimum_charge(currency: str) -> int:
    """Smallest chargeable amount in minor units (1 where Stripe documents none)."""
    return MINIMUM_CHARGE.get(normalize_currency(currency), 1)


def format_amount(amount: int, currency: str) -> str:
    """Human form for logs and the admin: ``format_amount(1050, "usd") == "10.50 USD"``."""
    exp = exponent(currency)
    if exp == 0:
        return f"{amount} {currency.upper()}"
    sign = "-" if amount < 0 else ""
    whole, frac = divmod(abs(amount), 10**exp)
    return f"{sign}{whole}.{frac:0{exp}d} {currency.upper()}"


def display(amount: int, currency: str, *, locale: str) -> str:
    """An amount in integer minor units as people read it, in ``locale`` (a Babel locale name).

    ``display(1500, "usd", locale="en_US") == "$15.00"``, ``display(1299, "eur", locale="en_US") == "€12.99"``,
    ``display(1000, "jpy", locale="en_US") == "¥1,000"``. The minor digits are the currency's exponent from
    Babel's ISO 4217 data (equal to :data:`CURRENCY_EXPONENTS`, tests/admin/test_console_display.py);
    symbol, grouping and order are the locale's. A code Babel does not know is written
    ``1500 (minor units, XYZ)`` rather than guessed.
    """
    code = (currency or "").upper()
    if not is_currency(code):
        return f"{amount} (minor units, {code or 'no currency'})"
    return format_currency(Decimal(amount).scaleb(-get_currency_precision(code)), code, locale=locale)
