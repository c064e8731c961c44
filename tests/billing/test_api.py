"""The billing endpoints: run now, run history, retry-billing, billing attempts, pay, void, credits."""

from datetime import timedelta

import pytest

from billing.api import schemas
from billing.models import BillingRun, Invoice, LedgerEntry, PaymentAttempt, Subscription
from billing.representations import billing_attempt_data, billing_run_data, ledger_entry_data, payment_attempt_data
from billing.services.drain import drain_due
from billing.services.ledger import grant_credit
from hardcount.times import database_now
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import DECLINING_CARD, wait_for_manual_runs


@pytest.fixture
def acme(book):
    return make_keys("Acme")


@pytest.fixture
def globex(book):
    return make_keys("Globex")


def _fail(sub):
    Subscription.objects.filter(pk=sub.pk).update(
        billing_failure_count=3, next_billing_attempt_at=database_now() + timedelta(hours=4)
    )


def test_billing_run_bills_only_the_callers_tenant_and_mode(book, acme, globex):
    mine = book.subscribed(acme.tenant)
    live_customer = book.customer(acme.tenant, livemode=True)
    live = book.subscription(live_customer, book.price(acme.tenant, livemode=True))
    theirs = book.subscribed(globex.tenant)

    status, started = Api(acme.test).post("/v1/billing/run", {})
    assert status == 200
    assert (started["object"], started["scope"], started["trigger"], started["status"]) == (
        "billing_run",
        "tenant",
        "manual",
        "running",
    )
    wait_for_manual_runs()

    status, run = Api(acme.test).get(f"/v1/billing/runs/{started['id']}")
    assert status == 200
    assert (run["object"], run["scope"], run["status"], run["attempted"], run["billed"]) == (
        "billing_run",
        "tenant",
        "completed",
        1,
        1,
    )
    assert Invoice.objects.filter(subscription=mine).count() == 1
    assert not Invoice.objects.filter(subscription__in=[live, theirs]).exists()
    assert Api(acme.test).get(f"/v1/billing/runs/{run['id']}") == (200, run)
    assert Api(acme.test).get("/v1/billing/runs")[1]["data"] == [run]
    assert Api(acme.live).get(f"/v1/billing/runs/{run['id']}")[0] == 404
    assert Api(globex.test).get(f"/v1/billing/runs/{run['id']}")[0] == 404
    assert Api(globex.test).get("/v1/billing/runs")[1]["data"] == []


def test_billing_run_refuses_unknown_fields_and_writes_nothing(book, acme):
    book.subscribed(acme.tenant)
    status, body = Api(acme.test).post("/v1/billing/run", {"page_size": 1})
    assert status == 422 and body["error"]["param"] == "page_size"
    assert not BillingRun.objects.exists()


def test_a_scheduler_run_shows_each_tenant_only_its_own_counts(book, acme, globex):
    book.subscribed(acme.tenant)
    for _ in range(3):
        book.subscribed(globex.tenant)
    drain_due(livemode=False, trigger="scheduler")

    acme_runs = Api(acme.test).get("/v1/billing/runs")[1]["data"]
    globex_runs = Api(globex.test).get("/v1/billing/runs")[1]["data"]

    assert [(r["scope"], r["attempted"], r["billed"], r["pages"]) for r in acme_runs] == [("all_tenants", 1, 1, None)]
    assert [(r["attempted"], r["billed"]) for r in globex_runs] == [(3, 3)]


def test_retry_billing_answers_409_unless_waiting_or_parked(book, acme, globex):
    sub = book.subscribed(acme.tenant)
    status, body = Api(acme.test).post(f"/v1/subscriptions/{sub.id}/retry-billing", {})
    assert (status, body["error"]["code"]) == (409, "subscription_not_failing")
    assert not BillingRun.objects.exists()

    _fail(sub)
    assert Api(globex.test).post(f"/v1/subscriptions/{sub.id}/retry-billing", {})[0] == 404
    status, attempt = Api(acme.test).post(f"/v1/subscriptions/{sub.id}/retry-billing", {})

    sub.refresh_from_db()
    assert status == 200
    assert (attempt["object"], attempt["outcome"], attempt["failure_number"]) == ("billing_attempt", "billed", 0)
    assert (sub.billing_failure_count, sub.billing_state, sub.periods_billed) == (0, "ok", 1)
    status, page = Api(acme.test).get(f"/v1/subscriptions/{sub.id}/billing_attempts")
    assert (status, [a["id"] for a in page["data"]]) == (200, [attempt["id"]])
    assert Api(globex.test).get(f"/v1/subscriptions/{sub.id}/billing_attempts")[0] == 404


def test_pay_and_void_over_http(book, acme, globex, make_card):
    declined = book.subscribed(acme.tenant, card=DECLINING_CARD)
    to_void = book.subscribed(acme.tenant, card=DECLINING_CARD)
    Api(acme.test).post("/v1/billing/run", {})
    wait_for_manual_runs()
    invoice = Invoice.objects.get(subscription=declined)
    customer = declined.customer
    customer.default_payment_method = make_card()
    customer.save(update_fields=["default_payment_method"])

    assert Api(globex.test).post(f"/v1/invoices/{invoice.id}/pay", {})[0] == 404
    status, paid = Api(acme.test).post(f"/v1/invoices/{invoice.id}/pay", {})
    assert (status, paid["status"], paid["amount_paid"]) == (200, "paid", 1000)
    status, again = Api(acme.test).post(f"/v1/invoices/{invoice.id}/pay", {})
    assert (status, again["error"]["code"]) == (409, "invoice_unexpected_state")
    status, attempts = Api(acme.test).get(f"/v1/invoices/{invoice.id}/payment_attempts")
    assert [(a["attempt_number"], a["outcome"]) for a in attempts["data"]] == [(2, "succeeded"), (1, "declined")]

    other = Invoice.objects.get(subscription=to_void)
    assert Api(acme.live).post(f"/v1/invoices/{other.id}/void", {})[0] == 404
    status, voided = Api(acme.test).post(f"/v1/invoices/{other.id}/void", {})
    assert (status, voided["status"]) == (200, "void")
    assert Api(acme.test).post(f"/v1/invoices/{other.id}/void", {})[0] == 409


def test_credits_are_granted_and_listed_and_bad_input_writes_nothing(book, acme, globex):
    customer = book.customer(acme.tenant, currency="usd")
    api = Api(acme.test)

    status, entry = api.post(f"/v1/customers/{customer.id}/credits", {"amount": 500, "description": "sorry"})
    assert status == 201
    assert (entry["amount"], entry["currency"], entry["balance_after"], entry["reason"]) == (500, "usd", 500, "grant")
    status, entry2 = api.post(f"/v1/customers/{customer.id}/credits", {"amount": -200, "currency": "usd"})
    assert (status, entry2["balance_after"], entry2["reason"]) == (201, 300, "adjustment")
    status, page = api.get(f"/v1/customers/{customer.id}/credits")
    assert [e["id"] for e in page["data"]] == [entry2["id"], entry["id"]]
    assert api.get(f"/v1/customers/{customer.id}")[1]["credit_balance"] == 300

    for body in ({"amount": "5"}, {"amount": 0}, {"amount": 5.0}, {"amount": 10**9}, {"amount": 5, "colour": "x"}):
        status, error = api.post(f"/v1/customers/{customer.id}/credits", body)
        assert status == 422, body
        assert set(error["error"]) == {"type", "code", "message", "param"}
    status, error = api.post(f"/v1/customers/{customer.id}/credits", {"amount": 5, "currency": "eur"})
    assert (status, error["error"]["code"]) == (422, "currency_mismatch")
    assert Api(globex.test).post(f"/v1/customers/{customer.id}/credits", {"amount": 5})[0] == 404
    assert Api(globex.test).get(f"/v1/customers/{customer.id}/credits")[0] == 404
    assert LedgerEntry.objects.count() == 2


def test_output_schemas_declare_exactly_the_keys_of_the_representations(book, acme):
    sub = book.subscribed(acme.tenant)
    book.customer(acme.tenant)
    run = drain_due(livemode=False, trigger="manual", tenant_id=acme.tenant.id)
    grant_credit(sub.customer_id, tenant_id=acme.tenant.id, livemode=False, amount=1)
    pairs = [
        (schemas.BillingRun, billing_run_data(run)),
        (schemas.BillingAttempt, billing_attempt_data(run.attempts.get())),
        (schemas.PaymentAttempt, payment_attempt_data(PaymentAttempt.objects.get())),
        (schemas.LedgerEntry, ledger_entry_data(LedgerEntry.objects.get())),
    ]
    for serializer, data in pairs:
        assert set(serializer().fields) == set(data), serializer.__name__
