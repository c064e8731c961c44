"""The console's changes of a subscription: each action makes what the API makes for the same request (rows and
events), refuses bad input without writing, shows the service's own refusal, and needs the change permission;
the subscription's page shows its items, pending invoice items, scheduled change and pause."""

from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse

from billing.models import Invoice, InvoiceItem, LedgerEntry, Price, Subscription, SubscriptionItem, TestClock
from billing.services import changes, invoice_items, pausing
from billing.services.drain import drain_due
from hardcount.models import AuditLogEntry
from hardcount.times import database_now
from outbox.models import Event
from tests.admin import rows
from tests.admin.conftest import changelist_ids, messages_of
from tests.api.conftest import Api, make_keys

SUBSCRIPTIONS = reverse("admin:billing_subscription_changelist")
INVOICE_ITEMS = reverse("admin:billing_invoiceitem_changelist")
APRIL_1, APRIL_16 = datetime(2027, 4, 1, tzinfo=UTC), datetime(2027, 4, 16, tzinfo=UTC)


def _change_url(sub) -> str:
    return reverse("admin:billing_subscription_change", args=[sub.pk])


def _billed_on_clock(book, tenant, *, quantity: int, anchor=APRIL_1):
    """3 (``quantity``) × a 10.00 USD "Seat" price on its own clock from ``anchor``, the first period paid."""
    clock = TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=anchor)
    customer = book.customer(tenant, clock=clock)
    price = Price.objects.create(
        tenant=tenant, livemode=False, amount=1000, currency="usd", interval="month", nickname="Seat"
    )
    sub = book.subscription(customer, price, anchor=anchor, quantity=quantity)
    drain_due(livemode=False, trigger="test_clock", tenant_id=tenant.id, test_clock_id=clock.id)
    assert Invoice.objects.get(subscription=sub).status == "paid"
    return clock, sub


def _move(clock, at):
    TestClock.objects.filter(pk=clock.pk).update(frozen_time=at)


def _events(sub, type_: str) -> list:
    return list(Event.objects.filter(type=type_, data__id=sub.pk).order_by("sequence"))


def _audit(sub) -> list[tuple[str, str, str]]:
    return list(
        AuditLogEntry.objects.filter(object_id=sub.pk).order_by("pk").values_list("action", "actor_label", "message")
    )


def _comparable(items) -> list[tuple]:
    return [(i.amount, i.description, i.proration, i.period_start, i.period_end, i.invoice_id) for i in items]


# --- change an item's quantity ----------------------------------------------------------------------------------------


def test_a_quantity_change_in_the_console_writes_what_the_api_writes(book, operator):
    keys = make_keys("Acme")
    api_clock, by_api = _billed_on_clock(book, keys.tenant, quantity=3)
    console_clock, by_console = _billed_on_clock(book, keys.tenant, quantity=3)
    for clock in (api_clock, console_clock):
        _move(clock, APRIL_16)  # 15 of April's 30 days left: exactly half
    api_item, console_item = SubscriptionItem.objects.get(subscription=by_api), by_console.items.get()

    status, body = Api(keys.test).post(
        f"/v1/subscriptions/{by_api.id}", {"items": [{"id": api_item.id, "quantity": 5}]}
    )
    assert status == 200, body
    page = operator.post(SUBSCRIPTIONS, {"action": "change_quantity", "_selected_action": [by_console.pk]})
    assert (
        page.status_code == 200 and b'name="quantity"' in page.content and b"Yes, I\xe2\x80\x99m sure" in page.content
    )
    assert not InvoiceItem.objects.filter(subscription=by_console).exists()  # the form page writes nothing
    response = operator.post(
        SUBSCRIPTIONS,
        {
            "action": "change_quantity",
            "_selected_action": [by_console.pk],
            "confirmed": "yes",
            "item": console_item.id,
            "quantity": "5",
            "proration_behavior": "create_prorations",
            "effective_at": "immediately",
        },
        follow=True,
    )

    assert messages_of(response) == [
        f"{by_console.pk}: changed item {console_item.id} to quantity 5 (create_prorations)."
    ]
    # Unused 3 × 10.00 × ½ = −15.00, remaining 5 × 10.00 × ½ = +25.00: both pending, on either path.
    made = list(InvoiceItem.objects.filter(subscription=by_console).order_by("id"))
    assert [(i.amount, i.invoice_id) for i in made] == [(-1500, None), (2500, None)]
    assert _comparable(made) == _comparable(InvoiceItem.objects.filter(subscription=by_api).order_by("id"))
    assert SubscriptionItem.objects.get(pk=console_item.pk).quantity == 5
    (api_event,) = [e for e in _events(by_api, "subscription.updated") if "previous_attributes" in e.data]
    (console_event,) = [e for e in _events(by_console, "subscription.updated") if "previous_attributes" in e.data]
    for event in (api_event, console_event):
        assert [i["quantity"] for i in event.data["previous_attributes"]["items"]["data"]] == [3]
        assert [i["quantity"] for i in event.data["items"]["data"]] == [5]
        assert event.created_at == APRIL_16  # the clock's time
    assert _audit(by_console) == [
        (
            "subscription.change_items",
            "operator-admin-test",
            f"Changed item {console_item.id} to quantity 5 (create_prorations).",
        )
    ]


def test_a_quantity_change_with_always_invoice_charges_its_invoice_once(book, operator, stripe_client):
    clock, sub = _billed_on_clock(book, book.tenant(), quantity=3)
    _move(clock, APRIL_16)

    response = operator.post(
        SUBSCRIPTIONS,
        {
            "action": "change_quantity",
            "_selected_action": [sub.pk],
            "confirmed": "yes",
            "item": sub.items.get().id,
            "quantity": "5",
            "proration_behavior": "always_invoice",
            "effective_at": "immediately",
        },
        follow=True,
    )

    invoice = Invoice.objects.get(subscription=sub, billing_reason=Invoice.UPDATE)
    assert (invoice.total, invoice.status) == (1000, "paid")  # −15.00 + 25.00
    assert messages_of(response)[0].endswith(f"Invoice {invoice.number} of $10.00: paid.")
    assert stripe_client.v1.payment_intents.retrieve(invoice.payment_intent_id).amount == 1000
    assert not InvoiceItem.objects.filter(subscription=sub, invoice__isnull=True).exists()


def test_a_quantity_change_at_period_end_is_scheduled_and_shown_on_the_page(book, operator):
    clock, sub = _billed_on_clock(book, book.tenant(), quantity=3)
    _move(clock, APRIL_16)
    item = sub.items.get()

    operator.post(
        SUBSCRIPTIONS,
        {
            "action": "change_quantity",
            "_selected_action": [sub.pk],
            "_return_to": "change",
            "confirmed": "yes",
            "item": item.id,
            "quantity": "1",
            "proration_behavior": "create_prorations",
            "effective_at": "period_end",
        },
    )

    sub.refresh_from_db()
    assert sub.scheduled_items == [{"id": item.id, "price": item.price_id, "quantity": 1}]
    assert SubscriptionItem.objects.get(pk=item.pk).quantity == 3 and not InvoiceItem.objects.exists()
    page = operator.get(_change_url(sub)).content.decode()
    assert "at the period's end, 2027-05-01 00:00 UTC (test clock)" in page
    assert f"{item.id}: quantity 3 → 1" in page


@pytest.mark.django_db
def test_a_bad_quantity_is_refused_on_the_form_and_nothing_is_written(tenant, operator):
    sub = rows.subscription(tenant)
    item = SubscriptionItem.objects.create(tenant=tenant, livemode=False, subscription=sub, price=sub.price, quantity=2)
    events_before = Event.objects.count()

    for quantity in ("0", "-1", "two", "10001", ""):
        response = operator.post(
            SUBSCRIPTIONS,
            {
                "action": "change_quantity",
                "_selected_action": [sub.pk],
                "confirmed": "yes",
                "item": item.id,
                "quantity": quantity,
                "proration_behavior": "create_prorations",
                "effective_at": "immediately",
            },
        )
        assert response.status_code == 200, quantity
        assert response.context["form"].errors.keys() == {"quantity"}, quantity
    response = operator.post(
        SUBSCRIPTIONS,
        {
            "action": "change_quantity",
            "_selected_action": [sub.pk],
            "confirmed": "yes",
            "item": "si_not_of_this_subscription",
            "quantity": "3",
            "proration_behavior": "sometimes",
            "effective_at": "immediately",
        },
    )
    assert response.context["form"].errors.keys() == {"item", "proration_behavior"}

    assert SubscriptionItem.objects.get(pk=item.pk).quantity == 2
    assert Event.objects.count() == events_before and not InvoiceItem.objects.exists()
    assert _audit(sub) == []


@pytest.mark.django_db
def test_a_change_the_service_refuses_shows_its_message_and_writes_nothing(tenant, operator):
    sub = rows.subscription(tenant, status="canceled", next_billing_at=None)
    item = SubscriptionItem.objects.create(tenant=tenant, livemode=False, subscription=sub, price=sub.price)
    events_before = Event.objects.count()

    response = operator.post(
        SUBSCRIPTIONS,
        {
            "action": "change_quantity",
            "_selected_action": [sub.pk],
            "confirmed": "yes",
            "item": item.id,
            "quantity": "4",
            "proration_behavior": "none",
            "effective_at": "immediately",
        },
        follow=True,
    )

    assert messages_of(response) == [f"{sub.pk}: not changed. Subscription '{sub.pk}' is canceled."]
    assert SubscriptionItem.objects.get(pk=item.pk).quantity == 1 and Event.objects.count() == events_before
    assert _audit(sub) == [
        (
            "subscription.change_items",
            "operator-admin-test",
            f"Change of item {item.id} to quantity 4 (none) refused: Subscription '{sub.pk}' is canceled.",
        )
    ]


@pytest.mark.django_db
def test_change_quantity_takes_one_subscription_at_a_time(tenant, operator):
    subs = [rows.subscription(tenant), rows.subscription(tenant)]

    response = operator.post(
        SUBSCRIPTIONS, {"action": "change_quantity", "_selected_action": [s.pk for s in subs]}, follow=True
    )

    assert messages_of(response) == ["Change the quantity of one subscription at a time; nothing was done."]


# --- cancel now with proration ----------------------------------------------------------------------------------------


def test_cancel_now_with_proration_credits_the_unused_time_as_the_api_does(book, operator):
    clock, sub = _billed_on_clock(book, book.tenant(), quantity=3)
    at = datetime(2027, 4, 11, 10, tzinfo=UTC)
    _move(clock, at)

    confirm = operator.post(SUBSCRIPTIONS, {"action": "cancel_now_prorated", "_selected_action": [sub.pk]})
    assert confirm.status_code == 200 and b"credit balance" in confirm.content
    assert Subscription.objects.get(pk=sub.pk).status == "active"
    response = operator.post(
        SUBSCRIPTIONS, {"action": "cancel_now_prorated", "_selected_action": [sub.pk], "confirmed": "yes"}, follow=True
    )

    # 3 × 10.00 × 1,692,000 / 2,592,000 s = 19.5833… → 19.58, rounded once.
    assert messages_of(response) == [f"{sub.pk}: canceled now; $19.58 credited to the customer's balance."]
    sub.refresh_from_db()
    assert (sub.status, sub.canceled_at) == ("canceled", at)
    entry = LedgerEntry.objects.get(customer_id=sub.customer_id, reason=LedgerEntry.PRORATION_CREDIT)
    assert (entry.amount, entry.currency, entry.balance_after) == (1958, "usd", 1958)
    assert len(_events(sub, "subscription.canceled")) == 1
    (granted,) = Event.objects.filter(type="customer.credit_granted")
    assert granted.data["amount"] == 1958 and granted.created_at == at
    assert _audit(sub) == [
        (
            "subscription.cancel_prorated",
            "operator-admin-test",
            "Canceled now; $19.58 credited to the customer's balance.",
        )
    ]


@pytest.mark.django_db
def test_cancel_now_with_proration_of_a_canceled_subscription_shows_the_refusal(tenant, operator):
    sub = rows.subscription(tenant, status="canceled", next_billing_at=None)

    response = operator.post(
        SUBSCRIPTIONS, {"action": "cancel_now_prorated", "_selected_action": [sub.pk], "confirmed": "yes"}, follow=True
    )

    (message,) = messages_of(response)
    assert message.startswith(f"{sub.pk}: not canceled. ") and "canceled" in message.removeprefix(f"{sub.pk}: not")
    assert not LedgerEntry.objects.exists() and not Event.objects.filter(type="subscription.canceled").exists()


# --- pause and resume collection --------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_pause_and_resume_in_the_console_emit_what_the_api_emits(operator):
    keys = make_keys("Acme")
    by_api, by_console = rows.subscription(keys.tenant), rows.subscription(keys.tenant)
    resumes_at = (database_now() + timedelta(days=10)).replace(second=0, microsecond=0)

    status, body = Api(keys.test).post(
        f"/v1/subscriptions/{by_api.pk}",
        {"pause_collection": {"behavior": "keep_as_draft", "resumes_at": int(resumes_at.timestamp())}},
    )
    assert status == 200, body
    page = operator.post(SUBSCRIPTIONS, {"action": "pause_collection", "_selected_action": [by_console.pk]})
    assert page.status_code == 200 and b'name="resumes_at"' in page.content
    response = operator.post(
        SUBSCRIPTIONS,
        {
            "action": "pause_collection",
            "_selected_action": [by_console.pk],
            "confirmed": "yes",
            "behavior": "keep_as_draft",
            "resumes_at": f"{resumes_at:%Y-%m-%d %H:%M}",
        },
        follow=True,
    )

    when = f"{resumes_at:%Y-%m-%d %H:%M} UTC"
    assert messages_of(response) == [f"{by_console.pk}: collection paused (keep_as_draft) until {when}."]
    for sub in (by_api, by_console):
        sub.refresh_from_db()
        assert (sub.pause_collection_behavior, sub.pause_collection_resumes_at) == ("keep_as_draft", resumes_at)
        (paused,) = _events(sub, "subscription.paused")
        assert paused.data["previous_attributes"] == {"pause_collection": None}
        assert paused.data["pause_collection"] == body["pause_collection"]
    page = operator.get(_change_url(by_console)).content.decode()
    assert f"paused, resumes at {when}: nothing is charged" in page and 'value="resume_collection"' in page
    assert f"paused until {when}" in operator.get(SUBSCRIPTIONS, {"billing_state": "paused"}).content.decode()

    status, _ = Api(keys.test).post(f"/v1/subscriptions/{by_api.pk}", {"pause_collection": None})
    assert status == 200
    response = operator.post(
        SUBSCRIPTIONS,
        {"action": "resume_collection", "_selected_action": [by_console.pk], "confirmed": "yes"},
        follow=True,
    )

    assert messages_of(response) == [f"{by_console.pk}: collection resumed."]
    for sub in (by_api, by_console):
        sub.refresh_from_db()
        assert (sub.pause_collection_behavior, sub.pause_collection_resumes_at) == ("", None)
        (resumed,) = _events(sub, "subscription.resumed")
        assert resumed.data["previous_attributes"] == {"pause_collection": body["pause_collection"]}
    assert [action for action, _user, _message in _audit(by_console)] == [
        "subscription.pause_collection",
        "subscription.resume_collection",
    ]


@pytest.mark.django_db
def test_a_pause_the_service_refuses_or_the_form_rejects_writes_nothing(tenant, operator):
    sub = rows.subscription(tenant)
    post = {"action": "pause_collection", "_selected_action": [sub.pk], "confirmed": "yes"}

    rejected = operator.post(SUBSCRIPTIONS, {**post, "behavior": "forever", "resumes_at": "next tuesday"})
    past = operator.post(SUBSCRIPTIONS, {**post, "behavior": "void", "resumes_at": "2020-01-01 00:00"}, follow=True)

    assert rejected.status_code == 200 and rejected.context["form"].errors.keys() == {"behavior", "resumes_at"}
    (message,) = messages_of(past)
    assert message.startswith(
        f"{sub.pk}: not paused. pause_collection.resumes_at must be after the subscription's current time "
    )
    sub.refresh_from_db()
    assert (sub.pause_collection_behavior, sub.pause_collection_resumes_at) == ("", None)
    assert not Event.objects.filter(type__in=["subscription.paused", "subscription.updated"]).exists()
    assert [action for action, _user, message in _audit(sub)] == ["subscription.pause_collection"]


@pytest.mark.django_db
def test_resuming_a_subscription_that_is_not_paused_changes_nothing(tenant, operator):
    sub = rows.subscription(tenant)

    response = operator.post(
        SUBSCRIPTIONS, {"action": "resume_collection", "_selected_action": [sub.pk], "confirmed": "yes"}, follow=True
    )

    assert messages_of(response) == [f"{sub.pk}: collection was not paused; nothing changed."]
    assert not Event.objects.filter(type="subscription.resumed").exists()


# --- who may act ------------------------------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    "action, fields",
    [
        ("change_quantity", {"quantity": "5", "proration_behavior": "none", "effective_at": "immediately"}),
        ("cancel_now_prorated", {}),
        ("pause_collection", {"behavior": "void"}),
        ("resume_collection", {}),
    ],
)
def test_staff_without_the_change_permission_cannot_run_a_change(tenant, viewer, action, fields):
    sub = rows.subscription(tenant, pause_collection_behavior="void" if action == "resume_collection" else "")
    item = SubscriptionItem.objects.create(tenant=tenant, livemode=False, subscription=sub, price=sub.price)
    events_before = Event.objects.count()

    response = viewer.post(
        SUBSCRIPTIONS,
        {"action": action, "_selected_action": [sub.pk], "confirmed": "yes", "item": item.id, **fields},
        follow=True,
    )

    assert response.status_code == 200  # the list again: there is no such action for this user
    sub.refresh_from_db()
    assert (sub.status, sub.pause_collection_behavior) == ("active", "void" if action == "resume_collection" else "")
    assert SubscriptionItem.objects.get(pk=item.pk).quantity == 1
    assert Event.objects.count() == events_before and not LedgerEntry.objects.exists() and _audit(sub) == []
    detail = viewer.get(_change_url(sub)).content.decode()
    assert f'value="{action}"' not in detail


# --- the subscription's page and the invoice items list ---------------------------------------------------------------


@pytest.mark.django_db
def test_the_page_shows_items_pending_items_the_scheduled_change_and_the_pause(tenant, operator):
    sub = rows.subscription(tenant)
    seat = Price.objects.create(tenant=tenant, livemode=False, amount=1250, currency="usd", interval="month")
    seat.nickname = "Seat"
    seat.save()
    base = SubscriptionItem.objects.create(tenant=tenant, livemode=False, subscription=sub, price=sub.price)
    seats = SubscriptionItem.objects.create(tenant=tenant, livemode=False, subscription=sub, price=seat, quantity=3)
    fee = invoice_items.create_invoice_item(
        tenant_id=tenant.id,
        livemode=False,
        customer_id=sub.customer_id,
        amount=-200,
        currency="usd",
        description="Goodwill",
        subscription_id=sub.id,
    )
    changes.change_subscription(
        tenant_id=tenant.id,
        livemode=False,
        subscription_id=sub.id,
        items=[{"id": seats.id, "quantity": 5}],
        effective_at="period_end",
    )
    pausing.update_pause_collection(
        tenant_id=tenant.id, livemode=False, subscription_id=sub.id, pause_collection={"behavior": "mark_uncollectible"}
    )

    page = operator.get(_change_url(sub)).content.decode()

    assert f"<td>{base.id}</td>" in page and f"<td>{seats.id}</td>" in page
    assert "<td>3</td><td>$12.50</td><td>$37.50</td>" in page  # quantity, unit amount, per period
    assert "<td>1</td><td>$10.00</td><td>$10.00</td>" in page
    assert fee.pk in page and "Goodwill" in page and "-$2.00" in page
    assert f"{seats.id}: quantity 3 → 5" in page and f"{base.id}: unchanged" in page
    assert "paused, until resumed by hand: nothing is charged" in page and "mark_uncollectible" in page
    assert 'value="resume_collection"' in page and 'value="change_quantity"' in page


@pytest.mark.django_db
def test_the_invoice_items_list_filters_by_customer_subscription_and_state(tenant, operator):
    first, second = rows.subscription(tenant), rows.subscription(tenant)

    def item(sub, **fields):
        return invoice_items.create_invoice_item(
            tenant_id=tenant.id, livemode=False, customer_id=sub.customer_id, amount=300, currency="usd", **fields
        ).pk

    of_first, first_customer_wide, of_second = item(first, subscription_id=first.id), item(first), item(second)
    InvoiceItem.objects.filter(pk=of_second).update(invoice=rows.invoice(second))

    assert changelist_ids(operator, INVOICE_ITEMS) == {of_first, first_customer_wide, of_second}
    assert changelist_ids(operator, INVOICE_ITEMS, {"customer": first.customer_id}) == {of_first, first_customer_wide}
    assert changelist_ids(operator, INVOICE_ITEMS, {"subscription": first.pk}) == {of_first}
    assert changelist_ids(operator, INVOICE_ITEMS, {"state": "pending"}) == {of_first, first_customer_wide}
    assert changelist_ids(operator, INVOICE_ITEMS, {"state": "invoiced"}) == {of_second}
    assert changelist_ids(operator, INVOICE_ITEMS, {"customer": second.customer_id, "state": "pending"}) == set()
    assert changelist_ids(operator, INVOICE_ITEMS, {"q": first.pk}) == {of_first}
    page = operator.get(INVOICE_ITEMS).content.decode()
    assert "$3.00" in page and 'name="action"' not in page  # read-only: amounts formatted, no actions
    assert operator.get(reverse("admin:billing_invoiceitem_change", args=[of_first])).status_code == 200
