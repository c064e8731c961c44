"""Billing's row locks, and the one order every writer takes them in.

The lock order (docs/decisions/0010-drain-claims-and-parallel-closes.md, 0016-page-close.md):

1. subscription
2. invoice
   - pending invoice items an invoice sweeps in (:func:`billing.services.lines.sweep_pending_locked`, id order)
   - credit notes and refunds of an invoice (written under the invoice's lock; a refund's record
     locks the refund row after its invoice, :func:`refund_qs_select_for_update`)
3. payment attempt
4. customer (the ledger's balance: every ledger write holds it)
   - a coupon redeemed, or a ``once`` discount claimed (:mod:`billing.services.discounts`: conditional updates)
5. invoice counter (:func:`billing.queries.next_invoice_number`) or credit-note counter
   (:func:`billing.queries.next_credit_note_number`), upserts: take them last

A transaction takes the kinds it needs in this order, several rows of one kind in id order, so
two writers never wait on each other crosswise. Rows written without being locked first (an
invoice or attempt a close inserts, the attempt step 1 re-sends) are written under the locks of
their subscription and invoice. Dunning's rows come after all of billing's (a decline opens or
moves its run inside billing's recording transaction, docs/decisions/0070); a test clock's row
is written last too (a close's failure reason), and the clock's own transactions lock nothing
else of billing's.

Each function below locks the rows of its own table only (``FOR UPDATE OF`` the table), so a
``select_related`` read beside it (a subscription's price) is never locked: closes of one price
would otherwise queue on its row (decision 0016). Some locks stay in SQL, in
:mod:`billing.queries`: the due claim and the close's re-lock (``FOR UPDATE SKIP LOCKED`` on
subscriptions, step 1) and the invoice counter; they take their place in the order above.
Everything here must run inside the caller's transaction.
"""

from __future__ import annotations

from django.db.models import Model, QuerySet

from billing.models import Customer, Invoice, PaymentAttempt, Refund, Subscription
from hardcount.errors import NotFoundError


def subscription_qs_select_for_update(*, skip_locked: bool = False) -> QuerySet[Subscription]:
    """Subscriptions locked ``FOR UPDATE OF`` the subscription (``SKIP LOCKED`` if asked), in id order. First."""
    return Subscription.objects.select_for_update(skip_locked=skip_locked, of=("self",)).order_by("pk")


def invoice_qs_select_for_update(*, skip_locked: bool = False) -> QuerySet[Invoice]:
    """Invoices locked ``FOR UPDATE OF`` the invoice (``SKIP LOCKED`` if asked), in id order. After subscriptions."""
    return Invoice.objects.select_for_update(skip_locked=skip_locked, of=("self",)).order_by("pk")


def payment_attempt_qs_select_for_update() -> QuerySet[PaymentAttempt]:
    """Payment attempts locked ``FOR UPDATE OF`` the attempt, in id order. After invoices."""
    return PaymentAttempt.objects.select_for_update(of=("self",)).order_by("pk")


def refund_qs_select_for_update() -> QuerySet[Refund]:
    """Refunds locked ``FOR UPDATE OF`` the refund, in id order. After their invoice."""
    return Refund.objects.select_for_update(of=("self",)).order_by("pk")


def customer_qs_select_for_update() -> QuerySet[Customer]:
    """Customers locked ``FOR UPDATE OF`` the customer, in id order. After payment attempts."""
    return Customer.objects.select_for_update(of=("self",)).order_by("pk")


def locked_by_id(queryset: QuerySet, ids) -> dict[str, Model]:
    """Lock the rows of ``ids`` (any iterable; repeats allowed) of a ``*_qs_select_for_update()`` queryset.

    Returns them by id; ids with no row are absent. In id order, so two writers locking sets of
    one kind never wait on each other crosswise.
    """
    return {row.pk: row for row in queryset.filter(pk__in=sorted(set(ids)))}


def subscription_locked(subscription_id: str) -> Subscription:
    """The subscription, locked, with its price read beside it (not locked). Raises ``Subscription.DoesNotExist``."""
    return subscription_qs_select_for_update().select_related("price").get(pk=subscription_id)


def customer_locked(customer_id: str) -> Customer:
    """The customer, locked (the ledger's balance row). Raises ``Customer.DoesNotExist``."""
    return customer_qs_select_for_update().get(pk=customer_id)


def callers_subscription_locked(tenant_id: str, livemode: bool, subscription_id: str) -> Subscription:
    """The caller's (tenant and mode) subscription, locked, with its price and test clock read beside it.

    Raises :class:`~hardcount.errors.NotFoundError` (``param="id"``) for one that is not the caller's.
    """
    sub = (
        subscription_qs_select_for_update()
        .select_related("price", "test_clock")
        .filter(tenant_id=tenant_id, livemode=livemode, pk=subscription_id)
        .first()
    )
    if sub is None:
        raise NotFoundError(f"No such subscription: '{subscription_id}'.", param="id")
    return sub


def callers_customer_locked(tenant_id: str, livemode: bool, customer_id: str) -> Customer:
    """The caller's (tenant and mode) customer, locked, with its test clock read beside it.

    Raises :class:`~hardcount.errors.NotFoundError` (``param="id"``) for one that is not the caller's.
    """
    customer = (
        customer_qs_select_for_update()
        .select_related("test_clock")
        .filter(tenant_id=tenant_id, livemode=livemode, pk=customer_id)
        .first()
    )
    if customer is None:
        raise NotFoundError(f"No such customer: '{customer_id}'.", param="id")
    return customer


def subscription_and_invoice_locked(
    invoice_id: str, *, subscription_id: str | None, skip_locked: bool = False
) -> tuple[Subscription | None, Invoice | None]:
    """Lock an invoice's subscription (``subscription_id``, None for an invoice without one), then the invoice.

    The subscription's price is read, not locked. ``skip_locked``: an invoice another
    transaction holds comes back None instead of being waited for (the subscription's lock is
    always waited for). Returns ``(subscription, invoice)``; the invoice is None when it does not
    exist. Raises ``Subscription.DoesNotExist`` for an unknown ``subscription_id``.
    """
    subscription = subscription_locked(subscription_id) if subscription_id else None
    invoice = invoice_qs_select_for_update(skip_locked=skip_locked).filter(pk=invoice_id).first()
    return subscription, invoice


def charge_rows_locked(
    *, subscription_id: str | None, invoice_id: str, attempt_id: str
) -> tuple[Subscription | None, Invoice, PaymentAttempt, Customer]:
    """Everything a charge's record writes, locked in order: subscription (with its price), invoice, attempt,
    and the invoice's customer.

    Returns ``(subscription, invoice, attempt, customer)`` (subscription None without
    ``subscription_id``). Raises the model's ``DoesNotExist`` for a row that is not there.
    """
    subscription = subscription_locked(subscription_id) if subscription_id else None
    invoice = invoice_qs_select_for_update().get(pk=invoice_id)
    attempt = payment_attempt_qs_select_for_update().get(pk=attempt_id)
    return subscription, invoice, attempt, customer_locked(invoice.customer_id)


__all__ = [
    "charge_rows_locked",
    "customer_locked",
    "customer_qs_select_for_update",
    "invoice_qs_select_for_update",
    "locked_by_id",
    "payment_attempt_qs_select_for_update",
    "refund_qs_select_for_update",
    "subscription_and_invoice_locked",
    "subscription_locked",
    "subscription_qs_select_for_update",
]
