"""``python manage.py doctor``: each check finds the violation planted for it, and nothing in a clean book.

One clean book (tests/doctor/world.py) is written once for the module and committed; every
test runs in its own transaction (pytest-django's ``db``), plants one violation with direct
ORM or SQL writes, and is rolled back. Where a database constraint already forbids the
violation (the partial unique index on invoices, CHECK constraints), the test drops the
constraint inside its transaction first, so the doctor is shown to find what the guard
would have stopped. Each test asserts the exact set of failing checks, so a check that
fires on a neighbour's violation shows up too.
"""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from billing.models import (
    BillingAttempt,
    BillingRun,
    Customer,
    Invoice,
    InvoiceCounter,
    InvoiceLineItem,
    LedgerEntry,
    PaymentAttempt,
    Price,
    Subscription,
    TestClock,
)
from dunning.models import DunningRun
from hardcount.models import Tenant
from leases.models import LeaderLease
from ops import doctor
from outbox.models import Delivery, DeliveryAttempt, Event, WebhookEndpoint
from tests.doctor.world import Book, build_world, id_at, wipe


@pytest.fixture(scope="module")
def world(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock():
        wipe()  # the sweep reads every tenant: start from an empty book whatever ran before
        w = build_world()
    yield w
    with django_db_blocker.unblock():
        wipe()


def failing(**kwargs) -> dict[str, doctor.CheckResult]:
    """Run every check; return the failing ones by name (errors fail the test at once)."""
    results = doctor.run_checks(**kwargs)
    errors = {r.name: r.note for r in results if r.status == doctor.ERROR}
    assert not errors, errors
    return {r.name: r for r in results if r.status == doctor.FAIL}


def assert_only(expected: dict[str, list[str]], **kwargs) -> dict[str, doctor.CheckResult]:
    """Exactly the checks in ``expected`` fail, each naming exactly the refs given (in any order)."""
    found = failing(**kwargs)
    assert set(found) == set(expected), {n: r.examples for n, r in found.items()}
    for name, refs in expected.items():
        got = sorted(example.split(": ", 1)[0] for example in found[name].examples)
        assert got == sorted(refs), (name, found[name].examples)
        assert found[name].violations == len(refs)
    return found


def sql(statement: str, params=()) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


# ------------------------------------------------------------------ the clean book and the command


def test_clean_book_passes_every_check(world, db):
    results = doctor.run_checks()
    assert len(results) >= 20
    assert {r.name: (r.status, r.examples) for r in results if r.status != doctor.OK} == {}


def test_every_check_has_a_unique_name_and_an_invariant():
    names = [c.name for c in doctor.CHECKS]
    assert len(names) == len(set(names))
    assert all(c.invariant.strip() and c.sql.strip() for c in doctor.CHECKS)


def test_sweep_runs_read_only(world, db):
    # A check that tries to write is refused by the READ ONLY transaction: it errors, nothing changes.
    writer = doctor.Check("writes", "never", "UPDATE billing_customer SET name = 'x' RETURNING id AS ref, '' AS detail")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(doctor, "CHECKS", (writer,))
        (swept,) = doctor.run_checks()
    assert swept.status == doctor.ERROR
    assert "read-only transaction" in swept.note
    assert not Customer.objects.filter(name="x").exists()


def test_command_prints_table_and_exits_zero_on_a_clean_book(world, db):
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_info:
        call_command("doctor", stdout=out)
    assert exit_info.value.code == 0
    text = out.getvalue()
    assert "invoice_one_per_period" in text
    assert f"all {len(doctor.CHECKS)} checks passed" in text


def test_command_exits_one_with_json_naming_the_violation(world, db):
    Invoice.objects.filter(pk=world.paid).update(subtotal=1999, total=2199, amount_due=1699)
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_info:
        call_command("doctor", "--json", stdout=out)
    assert exit_info.value.code == 1
    report = json.loads(out.getvalue())
    assert report["status"] == "fail"
    assert "invoice_subtotal_equals_lines" in report["failed"]
    by_name = {r["name"]: r for r in report["results"]}
    assert by_name["invoice_subtotal_equals_lines"]["violations"] == 1
    assert by_name["invoice_subtotal_equals_lines"]["examples"][0].startswith(world.paid + ": subtotal 1999")


def test_command_runs_only_the_named_checks(world, db):
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_info:
        call_command("doctor", "--check", "invoice_one_per_period", "--json", stdout=out)
    assert exit_info.value.code == 0
    assert [r["name"] for r in json.loads(out.getvalue())["results"]] == ["invoice_one_per_period"]


def test_command_passes_the_unknown_payment_window(world, db):
    attempt = PaymentAttempt.objects.get(invoice_id=world.declined, attempt_number=2)
    PaymentAttempt.objects.filter(pk=attempt.pk).update(
        outcome=PaymentAttempt.UNKNOWN, started_at=timezone.now() - timedelta(minutes=10)
    )
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_info:
        call_command("doctor", "--unknown-after", "300", "--check", "payment_outcome_not_left_unknown", stdout=out)
    assert exit_info.value.code == 1
    assert attempt.id in out.getvalue()


def test_command_refuses_an_unknown_check(world, db):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="unknown check"):
        call_command("doctor", "--check", "no_such_check")


def test_gateway_check_says_not_checked_without_a_gateway(world, db, settings):
    settings.STRIPE_API_BASE = ""
    settings.STRIPE_API_KEY = "sk_test_hardcount_localstripe"
    result = doctor.check_gateway()
    assert result.status == doctor.NOT_CHECKED
    assert doctor.exit_status([result]) == 0


# ------------------------------------------------------------------ invoices and periods


def test_second_invoice_for_a_period_is_found_when_the_unique_index_is_gone(world, db):
    sql("DROP INDEX invoice_one_per_period")
    Invoice.objects.filter(pk=world.voided).update(status=Invoice.OPEN, voided_at=None)
    found = assert_only({"invoice_one_per_period": [world.sub]})
    assert found["invoice_one_per_period"].examples[0].startswith(world.sub + ": 2 non-void invoices")
    assert world.voided in found["invoice_one_per_period"].examples[0]


def test_overlapping_period_is_found(world, db):
    inv = Invoice.objects.get(pk=world.declined)
    shifted = inv.period_start - timedelta(days=1)
    Invoice.objects.filter(pk=inv.pk).update(period_start=shifted)
    InvoiceLineItem.objects.filter(invoice_id=inv.pk).update(period_start=shifted)
    found = assert_only(
        {
            "invoice_periods_disjoint": [world.declined],
            "invoice_period_on_billing_cycle": [world.declined],
        }
    )
    assert "overlaps invoice " + world.paid in found["invoice_periods_disjoint"].examples[0]


def test_lost_period_gap_is_found(world, db):
    # The declined invoice (period 1) never existed: period 2 starts where nothing ended.
    runs = list(DunningRun.objects.filter(invoice_id=world.declined).values_list("id", flat=True))
    Event.objects.filter(data__id__in=runs).delete()
    DunningRun.objects.filter(invoice_id=world.declined).delete()
    PaymentAttempt.objects.filter(invoice_id=world.declined).delete()
    LedgerEntry.objects.filter(invoice_id=world.declined).delete()
    Event.objects.filter(data__id=world.declined).delete()
    # Keep the numbers gapless: renumber what follows.
    Invoice.objects.filter(pk=world.declined).delete()
    for n, inv in enumerate(Invoice.objects.filter(tenant_id=world.acme).exclude(number=None).order_by("number"), 1):
        Invoice.objects.filter(pk=inv.pk).update(number=f"ACME-{n:06d}")
    InvoiceCounter.objects.filter(tenant_id=world.acme).update(last_number=6)
    Subscription.objects.filter(pk=world.sub).update(status=Subscription.ACTIVE)  # no decline left
    found = assert_only({"subscription_periods_contiguous": [world.sub]})
    assert "leaves a gap" in found["subscription_periods_contiguous"].examples[0]


def test_next_billing_at_behind_a_paid_period_is_found(world, db):
    # Period 2 (Mar 31) was paid, yet the subscription is due for it again: it would be billed twice.
    sub = Subscription.objects.get(pk=world.sub)
    Subscription.objects.filter(pk=sub.pk).update(
        next_billing_at=sub.next_billing_at - timedelta(days=30), periods_billed=2
    )
    found = assert_only({"subscription_next_billing_at_last_period_end": [world.sub]})
    assert (
        "which was closed (paid, declined or taxed)"
        in found["subscription_next_billing_at_last_period_end"].examples[0]
    )


def test_next_billing_at_past_the_last_period_is_found(world, db):
    # Period 2 (May 1) was skipped without an invoice: a lost period.
    sub = Subscription.objects.get(pk=world.yen_sub)
    Subscription.objects.filter(pk=sub.pk).update(
        next_billing_at=sub.next_billing_at + timedelta(days=31), periods_billed=3
    )
    assert_only({"subscription_next_billing_at_last_period_end": [world.yen_sub]})


def failed_close_of_the_next_period(world, outcome: str) -> Invoice:
    """Period 3 of the world's subscription materialised and charged with ``outcome``, its period not advanced."""
    book = Book(Tenant.objects.get(pk=world.acme), False, "ACME")
    sub = Subscription.objects.select_related("price", "customer").get(pk=world.sub)
    inv = book.invoice(sub, 3, tax_bps=1000)
    Subscription.objects.filter(pk=sub.pk).update(next_billing_at=inv.period_start, periods_billed=3)
    book.attempt(inv, outcome)
    return inv


def test_failed_close_leaves_its_period_due_without_a_violation(world, db):
    failed_close_of_the_next_period(world, PaymentAttempt.ERROR)
    assert failing() == {}


def test_declined_close_that_did_not_advance_the_period_is_found(world, db):
    failed_close_of_the_next_period(world, PaymentAttempt.DECLINED)
    assert_only({"subscription_next_billing_at_last_period_end": [world.sub]})


def test_periods_billed_out_of_step_with_next_billing_at_is_found(world, db):
    Subscription.objects.filter(pk=world.yen_sub).update(periods_billed=1)
    found = assert_only({"subscription_next_billing_on_cycle": [world.yen_sub]})
    assert "but period 1 starts 2026-04-01" in found["subscription_next_billing_on_cycle"].examples[0]


def test_period_drifting_off_the_anchor_is_found(world, db):
    # Feb 28 + 1 month = Mar 28: the drift of "previous end + interval" instead of "anchor + n × interval".
    drifted = Invoice.objects.get(pk=world.declined).period_end.replace(day=28)
    Invoice.objects.filter(pk=world.declined).update(period_end=drifted)
    InvoiceLineItem.objects.filter(invoice_id=world.declined).update(period_end=drifted)
    assert_only(
        {
            "invoice_period_on_billing_cycle": [world.declined],
            "subscription_periods_contiguous": [world.sub],
        }
    )


def test_invoice_without_lines_is_found(world, db):
    InvoiceLineItem.objects.filter(invoice_id=world.zero).delete()
    assert_only({"invoice_lines_match_invoice": [world.zero]})


def test_line_not_matching_its_price_is_found(world, db):
    InvoiceLineItem.objects.filter(invoice_id=world.paid).update(quantity=2)
    found = assert_only({"invoice_lines_match_invoice": [world.paid]})
    assert "is not 2 × 2000" in found["invoice_lines_match_invoice"].examples[0]


def test_subtotal_not_equal_to_lines_is_found(world, db):
    InvoiceLineItem.objects.filter(invoice_id=world.reissued).update(amount=1900)
    assert_only({"invoice_subtotal_equals_lines": [world.reissued], "invoice_lines_match_invoice": [world.reissued]})


def test_total_not_subtotal_plus_tax_is_found_without_the_check_constraint(world, db):
    sql("ALTER TABLE billing_invoice DROP CONSTRAINT invoice_total_is_subtotal_less_discount_plus_tax")
    Invoice.objects.filter(pk=world.declined).update(tax=0)
    assert_only({"invoice_total_is_subtotal_plus_tax": [world.declined]})


def test_amount_due_not_total_minus_credit_is_found(world, db):
    Invoice.objects.filter(pk=world.declined).update(amount_due=2000)
    found = assert_only(
        {
            "invoice_amount_due_is_total_minus_credit": [world.declined],
            "payment_attempt_amount_matches_invoice": [
                a.id for a in PaymentAttempt.objects.filter(invoice_id=world.declined)
            ],
        }
    )
    assert "2200 − credit_applied 0 = 2200" in found["invoice_amount_due_is_total_minus_credit"].examples[0]


def test_negative_amount_due_is_found_without_the_check_constraint(world, db):
    sql("ALTER TABLE billing_invoice DROP CONSTRAINT invoice_amount_due_nonnegative")
    Invoice.objects.filter(pk=world.zero).update(credit_applied=5, amount_due=-5)
    assert_only(
        {
            "invoice_amount_due_is_total_minus_credit": [world.zero],
            "invoice_credit_matches_ledger": [world.zero],
            "money_amounts_nonnegative": [world.zero],  # amount_paid 0 exceeds amount_due -5
        }
    )


def test_negative_line_amount_is_found(world, db):
    line = InvoiceLineItem.objects.get(invoice_id=world.zero)
    InvoiceLineItem.objects.filter(pk=line.pk).update(amount=-100)
    Invoice.objects.filter(pk=world.zero).update(
        subtotal=-100, tax=100, total=0, tax_status=Invoice.TAX_CALCULATED, tax_rate_bps=1000
    )
    assert_only(
        {
            "money_amounts_nonnegative": [line.id, world.zero],  # the line, and the invoice's subtotal
            "invoice_lines_match_invoice": [world.zero],  # -100 is not 1 × the free price
        }
    )


def test_overpaid_invoice_is_found(world, db):
    Invoice.objects.filter(pk=world.paid).update(amount_paid=1800)
    assert_only({"money_amounts_nonnegative": [world.paid]})


def test_paid_invoice_without_paid_at_is_found(world, db):
    Invoice.objects.filter(pk=world.paid).update(paid_at=None)
    assert_only({"invoice_status_fields": [world.paid]})


def test_finalised_invoice_without_number_is_found(world, db):
    Invoice.objects.filter(pk=world.live_paid).update(number=None)
    found = assert_only({"invoice_status_fields": [world.live_paid], "invoice_numbers_gapless": [world.globex]})
    assert "counter at 1" in found["invoice_numbers_gapless"].examples[0]


def test_pending_tax_on_an_open_invoice_is_found(world, db):
    Invoice.objects.filter(pk=world.declined).update(tax_status=Invoice.TAX_PENDING)
    found = assert_only({"invoice_status_fields": [world.declined, world.declined]})
    assert sorted(found["invoice_status_fields"].examples) == [
        f"{world.declined}: open invoice with tax_status pending",
        f"{world.declined}: tax 200 at 1000 bps with tax_status pending",
    ]


def test_tax_charged_while_not_applicable_is_found(world, db):
    Invoice.objects.filter(pk=world.live_paid).update(tax=100, total=12100, amount_due=12100, amount_paid=12100)
    PaymentAttempt.objects.filter(invoice_id=world.live_paid).update(amount=12100)
    found = assert_only({"invoice_status_fields": [world.live_paid]})
    assert "tax 100 at 0 bps with tax_status not_applicable" in found["invoice_status_fields"].examples[0]


def test_gap_in_invoice_numbers_is_found(world, db):
    InvoiceCounter.objects.filter(tenant_id=world.acme, livemode=False).update(last_number=8)
    found = assert_only({"invoice_numbers_gapless": [world.acme]})
    assert (
        "7 numbered invoices with 7 distinct numbers in 1..7, counter at 8"
        in found["invoice_numbers_gapless"].examples[0]
    )


def test_duplicate_invoice_number_is_found_without_the_unique_constraint(world, db):
    sql("ALTER TABLE billing_invoice DROP CONSTRAINT invoice_number_unique")
    number = Invoice.objects.get(pk=world.paid).number
    Invoice.objects.filter(pk=world.declined).update(number=number)
    assert_only({"invoice_numbers_gapless": [world.acme]})


def test_credit_applied_without_its_ledger_entry_is_found(world, db):
    inv = Invoice.objects.get(pk=world.reissued)
    Invoice.objects.filter(pk=inv.pk).update(credit_applied=100, amount_due=inv.total - 100)
    PaymentAttempt.objects.filter(invoice_id=inv.pk).update(amount=inv.total - 100)
    Invoice.objects.filter(pk=inv.pk).update(amount_paid=inv.total - 100)
    assert_only({"invoice_credit_matches_ledger": [world.reissued]})


# ------------------------------------------------------------------ payments


def test_paid_invoice_without_a_succeeded_attempt_is_found(world, db):
    PaymentAttempt.objects.filter(invoice_id=world.reissued).update(outcome=PaymentAttempt.UNKNOWN)
    assert_only({"paid_invoice_has_one_success": [world.reissued]})


def test_second_successful_charge_is_found_without_the_unique_index(world, db):
    sql("DROP INDEX payment_attempt_one_success")
    inv = Invoice.objects.get(pk=world.paid)
    PaymentAttempt.objects.create(
        tenant_id=inv.tenant_id,
        livemode=False,
        invoice=inv,
        attempt_number=2,
        payment_intent_id=inv.payment_intent_id,
        idempotency_key=f"hc:{inv.id}:attempt:2",
        amount=inv.amount_due,
        currency=inv.currency,
        outcome=PaymentAttempt.SUCCEEDED,
    )
    assert_only({"paid_invoice_has_one_success": [world.paid], "invoice_at_most_one_success": [world.paid]})


def test_success_recorded_on_an_open_invoice_is_found(world, db):
    PaymentAttempt.objects.filter(invoice_id=world.declined, attempt_number=2).update(
        outcome=PaymentAttempt.SUCCEEDED, decline_code=""
    )
    found = assert_only({"succeeded_payment_marks_invoice_paid": [world.declined]})
    assert found["succeeded_payment_marks_invoice_paid"].examples[0].startswith(world.declined + ": open invoice")


def test_charge_of_another_amount_is_found(world, db):
    attempt = PaymentAttempt.objects.get(invoice_id=world.declined, attempt_number=2)
    PaymentAttempt.objects.filter(pk=attempt.pk).update(amount=1900)
    assert_only({"payment_attempt_amount_matches_invoice": [attempt.id]})


def test_gap_in_payment_attempt_numbers_is_found(world, db):
    PaymentAttempt.objects.filter(invoice_id=world.declined, attempt_number=2).update(attempt_number=3)
    assert_only({"payment_attempt_numbers_contiguous": [world.declined]})


def test_second_payment_intent_for_an_invoice_is_found(world, db):
    attempt = PaymentAttempt.objects.get(invoice_id=world.declined, attempt_number=2)
    PaymentAttempt.objects.filter(pk=attempt.pk).update(payment_intent_id="pi_another")
    assert_only({"one_payment_intent_per_invoice": [attempt.id]})


def test_payment_intent_shared_by_two_invoices_is_found(world, db):
    intent = Invoice.objects.get(pk=world.paid).payment_intent_id
    Invoice.objects.filter(pk=world.reissued).update(payment_intent_id=intent)
    PaymentAttempt.objects.filter(invoice_id=world.reissued).update(payment_intent_id=intent)
    found = assert_only({"one_payment_intent_per_invoice": [min(world.paid, world.reissued)]})
    assert "is shared by invoices" in found["one_payment_intent_per_invoice"].examples[0]


def test_idempotency_key_reused_with_another_amount_is_found(world, db):
    first = PaymentAttempt.objects.get(invoice_id=world.declined, attempt_number=1)
    second = PaymentAttempt.objects.get(invoice_id=world.declined, attempt_number=2)
    PaymentAttempt.objects.filter(pk=second.pk).update(idempotency_key=first.idempotency_key, amount=2100)
    found = failing()
    assert found["idempotency_key_one_body"].violations == 1
    assert "used by 1 invoices with 2 bodies" in found["idempotency_key_one_body"].examples[0]


def test_chargeable_amount_settled_without_a_call_is_found(world, db):
    attempt = PaymentAttempt.objects.get(invoice_id=world.carried)
    PaymentAttempt.objects.filter(pk=attempt.pk).update(settled_without_charge=True, payment_intent_id="")
    Invoice.objects.filter(pk=world.carried).update(payment_intent_id="")
    found = assert_only({"settled_without_charge_only_below_minimum": [attempt.id]})
    assert "is chargeable (minimum 50)" in found["settled_without_charge_only_below_minimum"].examples[0]


def test_below_minimum_amount_sent_to_the_gateway_is_found(world, db):
    attempt = PaymentAttempt.objects.get(invoice_id=world.below_minimum)
    PaymentAttempt.objects.filter(pk=attempt.pk).update(settled_without_charge=False, payment_intent_id="pi_small")
    Invoice.objects.filter(pk=world.below_minimum).update(payment_intent_id="pi_small")
    found = assert_only({"settled_without_charge_only_below_minimum": [attempt.id]})
    assert "below the minimum 50" in found["settled_without_charge_only_below_minimum"].examples[0]


def test_charge_left_unknown_is_found_after_the_window(world, db):
    attempt = PaymentAttempt.objects.get(invoice_id=world.declined, attempt_number=2)
    PaymentAttempt.objects.filter(pk=attempt.pk).update(
        outcome=PaymentAttempt.UNKNOWN, started_at=timezone.now() - timedelta(minutes=10)
    )
    assert failing(unknown_after_s=3600) == {}
    found = assert_only({"payment_outcome_not_left_unknown": [attempt.id]}, unknown_after_s=300)
    assert f"for invoice {world.declined} (open)" in found["payment_outcome_not_left_unknown"].examples[0]


# ------------------------------------------------------------------ the credit ledger


def test_stale_balance_after_is_found(world, db):
    # Two writers read the same balance without the row lock: the second entry starts from a stale balance.
    last = LedgerEntry.objects.filter(customer_id=world.alice, reason=LedgerEntry.GRANT).latest("created_at")
    LedgerEntry.objects.filter(pk=last.pk).update(
        balance_after=800
    )  # 500 + 300: it read the balance before 500 was applied
    found = assert_only({"ledger_balance_after_running_sum": [world.alice]})
    assert "balance 500 left 1 more time(s) than reached" in found["ledger_balance_after_running_sum"].examples[0]


def test_ledger_sharing_one_timestamp_is_still_one_chain(world, db):
    # Entries of one transaction (or one test-clock time) share created_at; order does not matter.
    LedgerEntry.objects.filter(customer_id=world.alice).update(created_at=timezone.now())
    LedgerEntry.objects.filter(customer_id=world.bob).update(created_at=timezone.now())
    assert failing() == {}


def test_credit_balance_not_matching_the_ledger_is_found(world, db):
    Customer.objects.filter(pk=world.bob).update(credit_balance=-40)
    found = assert_only({"customer_balance_matches_ledger": [world.bob]})
    assert "credit_balance -40 but the ledger sums to 0" in found["customer_balance_matches_ledger"].examples[0]


# ------------------------------------------------------------------ tenancy and currency


def test_invoice_of_another_tenants_customer_is_found(world, db):
    Invoice.objects.filter(pk=world.live_paid).update(customer_id=world.alice)
    found = failing()
    refs = [e.split(": ")[0] for e in found["no_cross_tenant_reference"].examples]
    assert world.live_paid in refs


def test_payment_attempt_in_another_mode_is_found(world, db):
    attempt = PaymentAttempt.objects.get(invoice_id=world.reissued)
    PaymentAttempt.objects.filter(pk=attempt.pk).update(livemode=True)
    assert_only({"no_cross_tenant_reference": [attempt.id]})


def test_delivery_to_another_tenants_endpoint_is_found(world, db):
    Delivery.objects.filter(pk=world.delivery_retrying).update(endpoint_id=world.endpoint_live)
    found = failing()
    assert found["no_cross_tenant_reference"].violations == 1
    assert found["no_cross_tenant_reference"].examples[0].startswith(world.delivery_retrying + ": delivery of event")
    assert "event_has_its_deliveries" in found  # and the event now lacks its delivery to the Acme endpoint


def test_ledger_entry_naming_another_customers_invoice_is_found(world, db):
    entry = LedgerEntry.objects.get(invoice_id=world.below_minimum)
    LedgerEntry.objects.filter(pk=entry.pk).update(invoice_id=world.paid)
    found = failing()
    assert found["no_cross_tenant_reference"].violations == 1
    assert "names invoice " + world.paid in found["no_cross_tenant_reference"].examples[0]


def test_line_in_another_currency_is_found(world, db):
    line = InvoiceLineItem.objects.get(invoice_id=world.paid)
    InvoiceLineItem.objects.filter(pk=line.pk).update(currency="eur")
    assert_only({"currency_consistent": [line.id]})


def test_price_in_another_currency_than_its_customer_is_found(world, db):
    Price.objects.filter(pk=world.monthly).update(currency="eur")
    found = failing()
    assert set(found) == {"currency_consistent"}
    assert found["currency_consistent"].violations >= 4  # every usd invoice and subscription on the price


def test_past_due_subscription_owing_nothing_is_found(world, db):
    Subscription.objects.filter(pk=world.yen_sub).update(status=Subscription.PAST_DUE)
    found = assert_only({"subscription_status_matches_invoices": [world.yen_sub]})
    assert found["subscription_status_matches_invoices"].examples == [
        world.yen_sub + ": past_due without an open invoice"
    ]


def test_active_subscription_with_a_declined_invoice_is_found(world, db):
    Subscription.objects.filter(pk=world.sub).update(status=Subscription.ACTIVE)
    found = assert_only({"subscription_status_matches_invoices": [world.sub]})
    assert (
        "active with declined open invoice " + world.declined
        in found["subscription_status_matches_invoices"].examples[0]
    )


# ------------------------------------------------------------------ billing failure state


def test_canceled_subscription_still_due_is_found(world, db):
    Subscription.objects.filter(pk=world.sub).update(status="canceled")
    found = assert_only({"canceled_subscription_bills_nothing": [world.sub]})
    assert "canceled but next_billing_at" in found["canceled_subscription_bills_nothing"].examples[0]


def test_parked_subscription_with_fewer_than_eight_failures_is_found(world, db):
    Subscription.objects.filter(pk=world.parked).update(billing_failure_count=7)
    assert_only({"parked_subscription_has_eight_failures": [world.parked]})


def test_waiting_subscription_without_failures_is_found(world, db):
    Subscription.objects.filter(pk=world.waiting).update(billing_failure_count=0)
    assert_only({"waiting_subscription_failure_state": [world.waiting]})


def test_failures_without_a_retry_time_are_found(world, db):
    Subscription.objects.filter(pk=world.waiting).update(next_billing_attempt_at=None)
    found = assert_only({"waiting_subscription_failure_state": [world.waiting]})
    assert "2 failures but no next_billing_attempt_at" in found["waiting_subscription_failure_state"].examples[0]


def test_test_clock_subscription_with_saved_failures_is_found(world, db):
    Subscription.objects.filter(pk=world.clock_sub).update(
        billing_failure_count=1, next_billing_attempt_at=timezone.now()
    )
    assert_only({"test_clock_subscription_has_no_failure_state": [world.clock_sub]})


def test_live_test_clock_is_found(world, db):
    TestClock.objects.filter(pk=world.clock).update(livemode=True)
    found = failing()
    assert set(found) == {"test_clocks_in_test_mode", "no_cross_tenant_reference"}
    assert found["test_clocks_in_test_mode"].examples == [world.clock + ": test clock in live mode"]


def test_wall_clock_stamps_on_a_test_clock_object_are_found(world, db):
    # The zero invoice's attempt was made at the clock's time (Jan 31): a wall-clock stamp lies past its frozen_time.
    attempt = PaymentAttempt.objects.get(invoice_id=world.zero)
    PaymentAttempt.objects.filter(pk=attempt.pk).update(completed_at=timezone.now())
    found = assert_only({"test_clock_times_on_its_timeline": [attempt.id]})
    (example,) = found["test_clock_times_on_its_timeline"].examples
    assert (
        "payment attempt completed_at" in example
        and f"is after the frozen_time 2026-01-31 10:00:00+00 of test clock {world.clock}" in example
    )


def test_a_wall_clock_stamp_before_the_clock_began_is_found_once_its_created_event_says_when(world, db):
    from billing.representations import test_clock_data
    from outbox.services import emit_event

    # The clock began in the future of the wall clock (as the test clocks of the suites do).
    began = timezone.now() + timedelta(days=60)
    TestClock.objects.filter(pk=world.clock).update(frozen_time=began + timedelta(days=30))
    clock = TestClock.objects.get(pk=world.clock)
    created = Event.objects.get(type="customer.created", data__id=world.dave)
    Event.objects.filter(pk=created.pk).update(created_at=timezone.now())  # the moment it was written
    assert failing() == {}  # without the clock's created event the timeline has no start

    emit_event(
        tenant_id=clock.tenant_id,
        livemode=False,
        type="test_clock.created",
        data=test_clock_data(clock),
        created_at=began,
    )
    # The clock's other rows are dated Jan 31, before it began too, but not when they were written: not reported.
    found = assert_only({"test_clock_times_on_its_timeline": [created.id]})
    assert (
        "the wall-clock time it was written at, is before the first time"
        in (found["test_clock_times_on_its_timeline"].examples[0])
    )


def test_a_test_clock_charge_left_unknown_is_aged_by_its_id(world, db):
    from billing.models import TestClock as Clock
    from tests.doctor.world import Book as WorldBook

    book = WorldBook(Tenant.objects.get(pk=world.acme), False, "ACME")
    clock = Clock.objects.get(pk=world.clock)
    customer = book.customer("frank@example.com", "usd", clock=clock)
    invoice = book.invoice(book.subscription(customer, book.price(2000, "usd"), clock.frozen_time), 0)
    minutes_ago = timezone.now() - timedelta(minutes=10)
    attempt = PaymentAttempt.objects.create(
        id=id_at("payment_attempt", minutes_ago),
        tenant_id=world.acme,
        livemode=False,
        invoice=invoice,
        attempt_number=1,
        idempotency_key=f"hc:{invoice.id}:create",
        payment_method="pm_card_visa",
        amount=invoice.amount_due,
        currency="usd",
        outcome=PaymentAttempt.UNKNOWN,
        # Dated by the clock, ten months before the wall clock: the age is the id's, not this.
        started_at=clock.frozen_time,
        completed_at=clock.frozen_time,
    )
    assert failing(unknown_after_s=3600) == {}
    assert_only({"payment_outcome_not_left_unknown": [attempt.id]}, unknown_after_s=300)


# ------------------------------------------------------------------ leases and billing runs


def test_run_still_running_under_an_old_token_is_found(world, db):
    BillingRun.objects.filter(pk=world.old_run).update(status=BillingRun.RUNNING, finished_at=None)
    found = assert_only({"billing_run_not_orphaned_by_lease": [world.old_run]})
    assert "the billing lease is at token 3" in found["billing_run_not_orphaned_by_lease"].examples[0]


def test_run_running_under_an_expired_lease_is_found(world, db):
    LeaderLease.objects.filter(role="billing").update(expires_at=timezone.now() - timedelta(seconds=1))
    found = assert_only({"billing_run_not_orphaned_by_lease": [world.live_run]})
    assert "expired since" in found["billing_run_not_orphaned_by_lease"].examples[0]


def test_billing_write_after_takeover_is_found(world, db):
    BillingAttempt.objects.filter(pk=world.old_attempt).update(created_at=timezone.now())
    assert_only({"no_billing_write_after_lease_lost": [world.old_attempt]})


def test_run_completed_after_takeover_is_found(world, db):
    BillingRun.objects.filter(pk=world.old_run).update(finished_at=timezone.now())
    assert_only({"no_billing_write_after_lease_lost": [world.old_run]})


def test_a_shard_run_that_attempted_another_shards_tenant_is_found(world, db, settings):
    from billing.shards import shard_of

    settings.HARDCOUNT_BILLING_SHARDS = 2
    tenant_id = BillingAttempt.objects.get(pk=world.old_attempt).subscription.tenant_id
    other = f"billing:{1 - shard_of(tenant_id, 2)}"
    LeaderLease.objects.create(role=other, holder="host:1:abc", token=5, acquired_at=timezone.now(),
                               heartbeat_at=timezone.now(), expires_at=timezone.now() + timedelta(hours=1))  # fmt: skip
    BillingRun.objects.filter(pk=world.old_run).update(lease_role=other, lease_token=4)
    assert failing() == {}  # a run of an older token: its shard count may have been another one
    BillingRun.objects.filter(pk=world.old_run).update(lease_token=5)
    found = assert_only({"scheduler_run_bills_only_its_shard": [world.old_attempt]})
    assert f"which is in shard {shard_of(tenant_id, 2)} of 2" in found["scheduler_run_bills_only_its_shard"].examples[0]


def test_held_lease_with_expiry_before_heartbeat_is_found(world, db):
    lease = LeaderLease.objects.get(role="billing")
    LeaderLease.objects.filter(pk="billing").update(expires_at=lease.heartbeat_at - timedelta(seconds=1))
    found = failing()
    assert "lease_rows_well_formed" in found
    assert found["lease_rows_well_formed"].examples[0].startswith("billing: held by host:1:abc")


# ------------------------------------------------------------------ events


def test_invoice_without_created_event_is_found(world, db):
    Event.objects.filter(type="invoice.created", data__id=world.zero).delete()
    assert_only({"invoice_has_created_event": [world.zero]})


def test_created_event_in_another_tenant_does_not_count(world, db):
    Event.objects.filter(type="invoice.created", data__id=world.live_paid).update(tenant_id=world.acme)
    found = failing()
    assert found["invoice_has_created_event"].examples == [world.live_paid + ": no invoice.created event"]
    assert "event_has_its_change" in found


def test_paid_invoice_without_paid_event_is_found(world, db):
    Event.objects.filter(type="invoice.paid", data__id=world.reissued).delete()
    found = assert_only({"invoice_state_has_event": [world.reissued]})
    assert found["invoice_state_has_event"].examples == [world.reissued + ": no invoice.paid event"]


def test_declined_charge_without_payment_failed_event_is_found(world, db):
    Event.objects.filter(type="invoice.payment_failed", data__id=world.declined).delete()
    assert_only({"invoice_state_has_event": [world.declined]})


def test_parked_subscription_without_its_event_is_found(world, db):
    Event.objects.filter(type="subscription.billing_parked").delete()
    assert_only({"object_has_created_event": [world.parked]})


def test_customer_without_created_event_is_found(world, db):
    Event.objects.filter(type="customer.created", data__id=world.dave).delete()
    assert_only({"object_has_created_event": [world.dave]})


def test_event_without_its_change_is_found(world, db):
    event = Event.objects.filter(type="invoice.paid", data__id=world.reissued).get()
    Event.objects.filter(pk=event.pk).update(data={"id": "in_00000000000000000000000000", "object": "invoice"})
    found = assert_only({"event_has_its_change": [event.id], "invoice_state_has_event": [world.reissued]})
    assert "which does not exist" in found["event_has_its_change"].examples[0]


def test_paid_event_for_an_unpaid_invoice_is_found(world, db):
    event = Event.objects.filter(type="invoice.payment_failed", data__id=world.declined).first()
    Event.objects.filter(pk=event.pk).update(type="invoice.paid")
    found = failing()
    assert found["event_has_its_change"].examples == [
        f"{event.id}: invoice.paid for invoice {world.declined}, which is open"
    ]


def test_event_missing_a_delivery_is_found(world, db):
    event = Event.objects.filter(type="invoice.paid", data__id=world.paid).get()
    Delivery.objects.filter(event=event, endpoint_id=world.endpoint_invoices).delete()
    found = assert_only({"event_has_its_deliveries": [event.id]})
    assert found["event_has_its_deliveries"].examples[0].endswith("no delivery to endpoint " + world.endpoint_invoices)


def test_event_older_than_retention_needs_no_delivery(world, db):
    event = Event.objects.filter(type="invoice.paid", data__id=world.paid).get()
    Delivery.objects.filter(event=event).delete()
    assert failing()["event_has_its_deliveries"].violations == 2
    # Written 31 days ago, when only an endpoint made 60 days ago existed.
    old_id = id_at("event", timezone.now() - timedelta(days=31))
    Event.objects.filter(pk=event.pk).update(id=old_id)
    endpoint = WebhookEndpoint.objects.create(
        id=id_at("webhook_endpoint", timezone.now() - timedelta(days=60)),
        tenant_id=world.acme,
        livemode=False,
        url="https://acme.example/old",
        enabled_events=["invoice.paid"],
        secret="whsec_o",
    )

    def missing(retention_days):
        (result,) = doctor.run_checks(
            names=["event_has_its_deliveries"], retention_days=retention_days, max_examples=99
        )
        return [e for e in result.examples if e.startswith(old_id)]

    assert missing(30) == []
    assert missing(40) == [f"{old_id}: invoice.paid has no delivery to endpoint {endpoint.id}"]


def test_endpoint_created_after_the_event_needs_no_delivery(world, db):
    WebhookEndpoint.objects.create(
        tenant_id=world.acme, livemode=False, url="https://acme.example/new", enabled_events=["*"], secret="whsec_n"
    )
    assert failing() == {}


# ------------------------------------------------------------------ deliveries


def test_ninth_delivery_attempt_is_found(world, db):
    Delivery.objects.filter(pk=world.delivery_retrying).update(attempts=9)
    assert_only(
        {
            "delivery_at_most_eight_attempts": [world.delivery_retrying],
            "delivery_attempt_numbers_contiguous": [world.delivery_retrying],
        }
    )


def test_gap_in_delivery_attempt_numbers_is_found(world, db):
    DeliveryAttempt.objects.create(delivery_id=world.delivery_retrying, number=3, status_code=500, executor="host:1")
    Delivery.objects.filter(pk=world.delivery_retrying).update(attempts=2)
    found = assert_only({"delivery_attempt_numbers_contiguous": [world.delivery_retrying]})
    assert "attempt rows numbered 1,3" in found["delivery_attempt_numbers_contiguous"].examples[0]


def test_attempt_spent_without_evidence_is_found(world, db):
    Delivery.objects.filter(pk=world.delivery_retrying).update(attempts=2)
    assert_only({"delivery_attempt_numbers_contiguous": [world.delivery_retrying]})


def test_delivery_succeeded_by_two_executors_is_found(world, db):
    DeliveryAttempt.objects.create(
        delivery_id=world.delivery_ok, number=2, outcome=DeliveryAttempt.SUCCEEDED, status_code=200, executor="host:2"
    )
    Delivery.objects.filter(pk=world.delivery_ok).update(attempts=2)
    assert_only({"delivery_succeeded_by_one_executor": [world.delivery_ok]})


def test_succeeded_delivery_without_a_succeeded_attempt_is_found(world, db):
    Delivery.objects.filter(pk=world.delivery_retrying).update(status=Delivery.SUCCEEDED, completed_at=timezone.now())
    assert_only({"delivery_status_matches_attempts": [world.delivery_retrying]})


def test_stale_claim_is_found_after_the_reaper_interval(world, db):
    Delivery.objects.filter(pk=world.delivery_in_flight).update(claim_expires_at=timezone.now() - timedelta(seconds=90))
    found = assert_only({"delivery_claim_not_stale": [world.delivery_in_flight]})
    assert "claimed by host:2/claim" in found["delivery_claim_not_stale"].examples[0]
    assert "delivery_claim_not_stale" not in failing(reaper_interval_s=120)


# ------------------------------------------------------------------ dunning


def test_declined_invoice_without_dunning_is_found(world, db):
    run = DunningRun.objects.get(invoice_id=world.declined)
    Event.objects.filter(data__id=run.id).delete()  # its dunning.* events go with it
    run.delete()
    assert_only({"declined_invoice_has_dunning_run": [world.declined]})


def test_active_dunning_on_a_paid_invoice_is_found(world, db):
    from dunning.services import start_dunning

    run = start_dunning(Invoice.objects.get(pk=world.paid), declined_at=timezone.now(), decline_code="")
    found = assert_only({"dunning_run_matches_invoice": [run.id]})
    assert "active dunning run for paid invoice" in found["dunning_run_matches_invoice"].examples[0]


def test_tenant_rows_unused_by_checks_are_harmless(world, db):
    Tenant.objects.create(name="Empty")
    assert failing() == {}


# ------------------------------------------------------------------ coupons and discounts (ops/sql/discounts.sql)


def test_a_line_discount_above_its_amount_is_found(world, db):
    line = InvoiceLineItem.objects.filter(invoice_id=world.paid).first()
    InvoiceLineItem.objects.filter(pk=line.pk).update(discount_amount=line.amount + 1)
    assert_only(
        {
            "line_discount_within_amount": [line.id],
            "invoice_discount_equals_lines": [world.paid],  # the invoice's total_discount is still 0
        }
    )


def test_a_line_discount_of_the_other_sign_is_found_and_a_whole_line_off_is_not(world, db):
    line = InvoiceLineItem.objects.filter(invoice_id=world.paid).first()
    assert line.amount > 0
    # A negative discount on a charge raises the line above what was billed for it.
    InvoiceLineItem.objects.filter(pk=line.pk).update(discount_amount=-1)
    assert_only({"line_discount_within_amount": [line.id], "invoice_discount_equals_lines": [world.paid]})
    # The boundary: the whole line off (100 %) leaves it at zero, never below; only the invoice's sum is off.
    InvoiceLineItem.objects.filter(pk=line.pk).update(discount_amount=line.amount)
    assert_only({"invoice_discount_equals_lines": [world.paid]})


def test_an_invoice_discount_that_is_not_its_lines_sum_is_found(world, db):
    line = InvoiceLineItem.objects.filter(invoice_id=world.paid).first()
    InvoiceLineItem.objects.filter(pk=line.pk).update(discount_amount=1)
    assert_only({"invoice_discount_equals_lines": [world.paid]})


def _coupon(tenant_id: str, **fields):
    from billing.models import Coupon

    return Coupon.objects.create(tenant_id=tenant_id, livemode=False, percent_off=10, duration="forever", **fields)


def test_a_redemption_count_without_its_discounts_is_found(world, db):
    coupon = _coupon(world.acme, times_redeemed=2)
    assert_only({"coupon_redemptions_counted": [coupon.id]})


def test_a_discount_across_tenants_is_found(world, db):
    from billing.models import Discount

    coupon = _coupon(world.globex, times_redeemed=1)
    customer = Customer.objects.filter(tenant_id=world.acme, livemode=False).first()
    discount = Discount.objects.create(
        tenant_id=world.acme, livemode=False, coupon=coupon, customer=customer, start=timezone.now()
    )
    assert_only({"discount_of_its_own_tenant": [discount.id]})


def test_every_check_has_a_test_that_plants_its_violation():
    from pathlib import Path

    # This module and its siblings (test_doctor_credit_notes.py, …) plant the violations.
    source = "".join(path.read_text() for path in sorted(Path(__file__).parent.glob("test_doctor*.py")))
    planted = {c.name for c in doctor.CHECKS if source.count(f'"{c.name}"') >= 1}
    assert planted == {c.name for c in doctor.CHECKS}
