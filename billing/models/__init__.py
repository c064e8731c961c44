"""Billing models, one module per concept."""

from billing.models.clocks import TestClock
from billing.models.credit_notes import CreditNote, CreditNoteCounter, CreditNoteLineItem, Refund
from billing.models.customers import Customer, Price
from billing.models.discounts import Coupon, Discount
from billing.models.gateway_accounts import GatewayAccount
from billing.models.invoices import Invoice, InvoiceCounter, InvoiceLineItem
from billing.models.items import InvoiceItem, SubscriptionItem
from billing.models.ledger import LedgerEntry
from billing.models.meters import Meter, MeterEvent, MeterEventIdentifier
from billing.models.payments import PaymentAttempt
from billing.models.runs import BillingAttempt, BillingRun
from billing.models.stripe_events import StripeEvent
from billing.models.subscriptions import Subscription

__all__ = [
    "BillingAttempt",
    "BillingRun",
    "Coupon",
    "CreditNote",
    "CreditNoteCounter",
    "CreditNoteLineItem",
    "Customer",
    "Discount",
    "GatewayAccount",
    "Invoice",
    "InvoiceCounter",
    "InvoiceItem",
    "InvoiceLineItem",
    "LedgerEntry",
    "Meter",
    "MeterEvent",
    "MeterEventIdentifier",
    "PaymentAttempt",
    "Price",
    "Refund",
    "StripeEvent",
    "Subscription",
    "SubscriptionItem",
    "TestClock",
]
