"""The console's part of subscriptions that change: items, pending invoice items, a scheduled change, a pause.

:class:`SubscriptionChangeActions` adds to the subscription admin (:mod:`billing.admin`) what its
page shows of them and the actions that change them, each through the service the API calls for
the same request (docs/decisions/0150-console-subscription-changes.md):

- **Change quantity** — :func:`billing.services.changes.change_subscription` with one item's new
  quantity, as ``POST /v1/subscriptions/{id}`` with ``items: [{id, quantity}]``;
- **Cancel now with proration** — :func:`billing.services.changes.cancel_subscription` with
  ``prorate``, as ``POST /v1/subscriptions/{id}/cancel`` with ``prorate: true``;
- **Pause collection** and **Resume collection** —
  :func:`billing.services.pausing.update_pause_collection`, as ``POST /v1/subscriptions/{id}`` with
  ``pause_collection``.

Each asks for confirmation on a page that also takes its input; a refusal shows the service's own
message and is recorded in the audit log like a success, one entry per subscription.
"""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.db.models import Sum
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from billing.models import InvoiceItem, LedgerEntry, Price, Subscription
from billing.models.subscriptions import PauseBehavior
from billing.serializers import MAX_QUANTITY
from billing.services import changes, pausing
from billing.services.items import scheduled_items
from billing.services.lines import pending_for
from hardcount import audit
from hardcount.admin import action_form, clock_time, id_link, money, price_label, short_time
from hardcount.errors import ServiceError

CHANGE_ITEMS = "subscription.change_items"
PAUSE_COLLECTION, RESUME_COLLECTION = "subscription.pause_collection", "subscription.resume_collection"
CANCEL_PRORATED = "subscription.cancel_prorated"
AUDIT_ACTIONS = audit.actions(CHANGE_ITEMS, PAUSE_COLLECTION, RESUME_COLLECTION, CANCEL_PRORATED)

# What each behaviour does, in the operator's words (the choices of the forms and the page's pause line).
PRORATION_WORDS = {
    changes.CREATE_PRORATIONS: "create_prorations — credit and charge the rest of this period on the next invoice",
    changes.ALWAYS_INVOICE: "always_invoice — invoice the prorations now and charge that invoice at once",
    changes.NONE: "none — no prorations: the next invoice bills the new quantity",
}
PAUSE_WORDS = {
    PauseBehavior.KEEP_AS_DRAFT: "keep_as_draft — each period that comes due is invoiced as a draft, never finalised",
    PauseBehavior.MARK_UNCOLLECTIBLE: "mark_uncollectible — each period's invoice is finalised and marked "
    "uncollectible",
    PauseBehavior.VOID: "void — each period's invoice is created and voided at once",
}
# Pending invoice items shown on a subscription's page; the list behind the link has them all.
PENDING_SHOWN = 20


def _item_label(item) -> str:
    price = item.price
    name = f"“{price.nickname}” " if price.nickname else ""
    return f"{name}{price_label(price.amount, price.currency, price.interval, price.interval_count)} × {item.quantity}"


class ChangeQuantityForm(forms.Form):
    """One item's new quantity, how to prorate it and when it applies (the API's update fields of those names)."""

    item = forms.ChoiceField(label="item")
    quantity = forms.IntegerField(label="new quantity", min_value=1, max_value=MAX_QUANTITY)
    proration_behavior = forms.ChoiceField(
        label="proration", choices=list(PRORATION_WORDS.items()), initial=changes.CREATE_PRORATIONS
    )
    effective_at = forms.ChoiceField(
        label="applies",
        choices=[
            ("immediately", "now"),
            (changes.PERIOD_END, "at the end of the current period (scheduled; nothing is prorated)"),
        ],
        initial="immediately",
    )

    def __init__(self, data=None, *, subscription: Subscription):
        super().__init__(data)
        items = list(subscription.items.select_related("price").order_by("created_at", "id"))
        self.fields["item"].choices = [(item.id, f"{_item_label(item)} ({item.id})") for item in items]


class PauseCollectionForm(forms.Form):
    """Stripe's ``pause_collection``: a behaviour and an optional ``resumes_at`` (UTC)."""

    behavior = forms.ChoiceField(label="behavior", choices=list(PAUSE_WORDS.items()))
    resumes_at = forms.DateTimeField(
        label="resumes at (UTC)",
        required=False,
        input_formats=["%Y-%m-%d %H:%M", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d"],
        help_text="YYYY-MM-DD HH:MM in UTC (the test clock's time for a subscription on one); "
        "empty: paused until resumed here or through the API.",
    )


class SubscriptionChangeActions:
    """Mixin of :class:`billing.admin.SubscriptionAdmin`: the items, pending items, scheduled change and pause of a
    subscription's page, and the actions that change them (needs :class:`hardcount.admin.ReadOnlyAdmin`)."""

    CHANGE_ACTIONS = ("change_quantity", "cancel_now_prorated", "pause_collection", "resume_collection")
    CHANGE_OBJECT_ACTIONS = (
        ("change_quantity", "Change quantity"),
        ("cancel_now_prorated", "Cancel now with proration"),
        ("pause_collection", "Pause collection"),
        ("resume_collection", "Resume collection"),
    )
    CHANGE_FIELDSET = (
        "Items and changes",
        {"fields": ("items_table", "pending_items_table", "scheduled_change_display", "pause_display")},
    )
    CHANGE_READONLY_FIELDS = ("items_table", "pending_items_table", "scheduled_change_display", "pause_display")

    def change_action_applies(self, sub: Subscription, action: str) -> bool:
        """Whether the page offers ``action``'s button: a change or a pause of a live subscription, a resume of a
        paused one (the service decides all the same)."""
        if action == "resume_collection":
            return bool(sub.pause_collection_behavior)
        return sub.status != Subscription.CANCELED

    # --- what the page shows ------------------------------------------------------------------------------------

    @admin.display(description="items")
    def items_table(self, sub: Subscription):
        items = sub.items.select_related("price").order_by("created_at", "id")
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    item.id,
                    id_link(Price, item.price_id, text=item.price.nickname or item.price_id),
                    item.quantity,
                    money(item.price.amount, item.price.currency),
                    money(item.quantity * item.price.amount, item.price.currency),
                )
                for item in items
            ),
        )
        if not rows:
            return "none"
        return format_html(
            "<table><tr><th>item</th><th>price</th><th>quantity</th><th>unit amount</th><th>per period</th></tr>"
            "{}</table>",
            rows,
        )

    @admin.display(description="pending invoice items (its next invoice takes them)")
    def pending_items_table(self, sub: Subscription):
        pending = list(
            InvoiceItem.objects.filter(pending_for(sub, sub.price.currency)).order_by("created_at", "id")[
                : PENDING_SHOWN + 1
            ]
        )
        if not pending:
            return "none"
        on_clock = bool(sub.test_clock_id)
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    id_link(InvoiceItem, item.pk),
                    clock_time(item.created_at, on_clock=on_clock),
                    item.description or "—",
                    "proration" if item.proration else ("customer-wide" if item.subscription_id is None else "one-off"),
                    money(item.amount, item.currency),
                )
                for item in pending[:PENDING_SHOWN]
            ),
        )
        url = reverse("admin:billing_invoiceitem_changelist") + f"?customer={sub.customer_id}&state=pending"
        more = f"the first {PENDING_SHOWN} shown; " if len(pending) > PENDING_SHOWN else ""
        return format_html(
            "<table><tr><th>item</th><th>created</th><th>description</th><th>kind</th><th>amount</th></tr>{}</table>"
            '{}<a href="{}">the customer\'s pending invoice items</a>',
            rows,
            more,
            url,
        )

    @admin.display(description="scheduled change")
    def scheduled_change_display(self, sub: Subscription):
        if not sub.scheduled_items:
            return "none"
        current = {item.id: item for item in sub.items.select_related("price")}
        after = scheduled_items(sub)
        lines = []
        for item in after:
            before = current.get(item.id) if item.id else None
            if before is None:
                what = f"added: {_item_label(item)}"
            else:
                parts = []
                if before.price_id != item.price.id:
                    parts.append(
                        f"price {_item_label(before).rsplit(' × ', 1)[0]} → {_item_label(item).rsplit(' × ', 1)[0]}"
                    )
                if before.quantity != item.quantity:
                    parts.append(f"quantity {before.quantity} → {item.quantity}")
                what = f"{item.id}: " + ("; ".join(parts) if parts else "unchanged")
            lines.append((what,))
        kept = {item.id for item in after if item.id}
        lines += [
            (f"{item_id}: removed ({_item_label(item)})",) for item_id, item in current.items() if item_id not in kept
        ]
        return format_html(
            "at the period's end, {} (the next invoice bills it; nothing is prorated):<br>{}",
            clock_time(sub.next_billing_at, on_clock=bool(sub.test_clock_id)),
            format_html_join(mark_safe("<br>"), "{}", lines),
        )

    @admin.display(description="payment collection")
    def pause_display(self, sub: Subscription) -> str:
        if not sub.pause_collection_behavior:
            return "running: due periods are invoiced and charged"
        resumes_at = sub.pause_collection_resumes_at
        when = (
            f"resumes at {clock_time(resumes_at, on_clock=bool(sub.test_clock_id))}"
            if resumes_at
            else "until resumed by hand"
        )
        behavior = PAUSE_WORDS[PauseBehavior(sub.pause_collection_behavior)]
        return f"paused, {when}: nothing is charged, dunning included; {behavior}"

    # --- actions ------------------------------------------------------------------------------------------------

    @admin.action(description="Change an item's quantity (one subscription)", permissions=["operate"])
    def change_quantity(self, request, queryset):
        """As ``POST /v1/subscriptions/{id}`` with ``items: [{id, quantity}]``, ``proration_behavior`` and
        ``effective_at``."""
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        if len(rows) != 1:
            self.message_user(
                request, "Change the quantity of one subscription at a time; nothing was done.", messages.ERROR
            )
            return None
        (sub,) = rows
        form = action_form(request, ChangeQuantityForm, subscription=sub)
        confirmation = self.confirm_action(
            request,
            rows,
            action="change_quantity",
            question=f"Change an item's quantity of {sub.id}?",
            consequence="The change emits subscription.updated to the tenant's webhooks. With always_invoice the "
            "prorations are invoiced and charged now.",
            form=form,
        )
        if confirmation is not None:
            return confirmation
        data = form.cleaned_data
        what = f"item {data['item']} to quantity {data['quantity']} ({data['proration_behavior']}" + (
            ", at period end)" if data["effective_at"] == changes.PERIOD_END else ")"
        )
        try:
            _sub, invoice = changes.change_subscription(
                tenant_id=sub.tenant_id,
                livemode=sub.livemode,
                subscription_id=sub.id,
                items=[{"id": data["item"], "quantity": data["quantity"]}],
                proration_behavior=data["proration_behavior"],
                effective_at=data["effective_at"],
            )
        except ServiceError as exc:
            self.message_user(request, f"{sub.id}: not changed. {exc.message}", messages.WARNING)
            self.record_action(request, CHANGE_ITEMS, sub, f"Change of {what} refused: {exc.message}")
            return self.after_action(request, rows)
        message = f"{sub.id}: changed {what}."
        if invoice is not None:
            total = money(invoice.total, invoice.currency)
            message += f" Invoice {invoice.number or invoice.id} of {total}: {invoice.status}."
        self.message_user(request, message, messages.SUCCESS)
        self.record_action(request, CHANGE_ITEMS, sub, _sentence(message.removeprefix(f"{sub.id}: ")))
        return self.after_action(request, rows)

    @admin.action(description="Cancel now, crediting the unused time", permissions=["operate"])
    def cancel_now_prorated(self, request, queryset):
        """As ``POST /v1/subscriptions/{id}/cancel`` with ``prorate: true``."""
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        confirmation = self.confirm_action(
            request,
            rows,
            action="cancel_now_prorated",
            question=f"Cancel {len(rows)} subscription(s) now, crediting the unused time?",
            consequence="The unused time of each invoiced current period goes to the customer's credit balance "
            "(one ledger entry per item). Each cancellation emits its events; it cannot be undone here.",
        )
        if confirmation is not None:
            return confirmation
        for sub in rows:
            try:
                changes.cancel_subscription(
                    tenant_id=sub.tenant_id, livemode=sub.livemode, subscription_id=sub.id, prorate=True
                )
            except ServiceError as exc:
                self.message_user(request, f"{sub.id}: not canceled. {exc.message}", messages.WARNING)
                self.record_action(request, CANCEL_PRORATED, sub, f"Cancel now with proration refused: {exc.message}")
                continue
            credited = _credited_on_cancel(sub)
            message = f"canceled now; {money(credited, sub.price.currency)} credited to the customer's balance."
            self.message_user(request, f"{sub.id}: {message}", messages.SUCCESS)
            self.record_action(request, CANCEL_PRORATED, sub, _sentence(message))
        return self.after_action(request, rows)

    @admin.action(description="Pause payment collection", permissions=["operate"])
    def pause_collection(self, request, queryset):
        """As ``POST /v1/subscriptions/{id}`` with ``pause_collection: {behavior, resumes_at}``."""
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        form = action_form(request, PauseCollectionForm)
        confirmation = self.confirm_action(
            request,
            rows,
            action="pause_collection",
            question=f"Pause payment collection of {len(rows)} subscription(s)?",
            consequence="While paused nothing is charged, dunning included; each period that comes due is still "
            "invoiced once, its invoice settled as the behavior says. Each pause emits subscription.paused (or "
            "subscription.updated for a paused one).",
            form=form,
        )
        if confirmation is not None:
            return confirmation
        behavior, resumes_at = form.cleaned_data["behavior"], form.cleaned_data["resumes_at"]
        when = f"until {short_time(resumes_at)}" if resumes_at else "until resumed"
        for sub in rows:
            try:
                pausing.update_pause_collection(
                    tenant_id=sub.tenant_id,
                    livemode=sub.livemode,
                    subscription_id=sub.id,
                    pause_collection={"behavior": behavior, "resumes_at": resumes_at},
                )
            except ServiceError as exc:
                self.message_user(request, f"{sub.id}: not paused. {exc.message}", messages.WARNING)
                self.record_action(request, PAUSE_COLLECTION, sub, f"Pause ({behavior}) refused: {exc.message}")
                continue
            self.message_user(request, f"{sub.id}: collection paused ({behavior}) {when}.", messages.SUCCESS)
            self.record_action(request, PAUSE_COLLECTION, sub, f"Collection paused ({behavior}) {when}.")
        return self.after_action(request, rows)

    @admin.action(description="Resume payment collection", permissions=["operate"])
    def resume_collection(self, request, queryset):
        """As ``POST /v1/subscriptions/{id}`` with ``pause_collection: null``."""
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        confirmation = self.confirm_action(
            request,
            rows,
            action="resume_collection",
            question=f"Resume payment collection of {len(rows)} subscription(s)?",
            consequence="The next period that comes due is invoiced and charged as usual; invoices written while "
            "paused stay as they are. Each resume emits subscription.resumed.",
        )
        if confirmation is not None:
            return confirmation
        for sub in rows:
            try:
                pausing.update_pause_collection(
                    tenant_id=sub.tenant_id, livemode=sub.livemode, subscription_id=sub.id, pause_collection=None
                )
            except ServiceError as exc:
                self.message_user(request, f"{sub.id}: not resumed. {exc.message}", messages.WARNING)
                self.record_action(request, RESUME_COLLECTION, sub, f"Resume refused: {exc.message}")
                continue
            if sub.pause_collection_behavior:
                message, level = "collection resumed.", messages.SUCCESS
            else:
                message, level = "collection was not paused; nothing changed.", messages.WARNING
            self.message_user(request, f"{sub.id}: {message}", level)
            self.record_action(request, RESUME_COLLECTION, sub, _sentence(message))
        return self.after_action(request, rows)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _credited_on_cancel(sub: Subscription) -> int:
    """The proration credit a cancel of ``sub`` wrote, minor units (its entries name the subscription they cancel)."""
    entries = LedgerEntry.objects.filter(
        customer_id=sub.customer_id,
        reason=LedgerEntry.PRORATION_CREDIT,
        description__endswith=f"(canceled {sub.id})",
    )
    return entries.aggregate(total=Sum("amount"))["total"] or 0
