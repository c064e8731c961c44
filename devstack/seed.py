"""The demo book: a realistic, deterministic test-mode book of subscriptions for one tenant, written in bulk.

``python manage.py seed_demo`` and ``make run`` (on first start) call :func:`seed_demo_book`; the
drain benchmark (``bench/drain.py``) bills the same book. What a book of ``n`` subscriptions holds
(docs/decisions/0100-demo-book.md):

- ``n`` customers with names and emails, one subscription each, on ten prices: monthly, yearly and
  weekly, in USD, EUR and JPY (JPY amounts in whole yen: the currency has no minor unit);
- monthly and yearly anchors on every day of the month, 29th–31st included, at the latest such
  instant not after now (so the first period is due now; a 29th–31st anchor clamped into a
  shorter month can leave two periods due, as an imported book would); weekly anchors within
  the last week. About 8% are trialing instead, their trial ending in the next two weeks (not due);
- payment methods: Stripe's test PaymentMethod ``pm_card_visa`` for most; 3% ``pm_card_chargeCustomerFail``
  (attaches, then every charge is declined: ``past_due`` and dunning); 1% a PaymentMethod id the
  gateway does not know, so the gateway answers 404 at attach time (a gateway error: the close
  fails and the subscription waits on the retry ladder). Both magic ids work in localstripe and in
  Stripe's test mode;
- credit balances for 5% of the customers: half of them cover the first invoice in full (paid
  without a gateway call), half a third of it;
- webhook endpoints subscribed to ``*``: a working one at ``webhook_url`` (reused if the tenant
  already has it) and one that always fails (nothing listens at :data:`FAILING_WEBHOOK_URL`).

Every row gets the event its API twin would emit (``price.created``, ``customer.created``,
``customer.credit_granted``, ``subscription.created``) and its deliveries, in one transaction, so
the doctor finds the seeded book clean. The book is a function of ``(n, seed, now)``: ids and
creation times differ between runs, nothing else. Gateway customers are not created here: the
gateway creates each one lazily on its first charge (:mod:`billing.gateway`).
"""

from __future__ import annotations

import calendar
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db import transaction

from billing.models import Customer, LedgerEntry, Price, Subscription, SubscriptionItem
from billing.representations import customer_data, ledger_entry_data, price_data, subscription_data
from hardcount.bulk import copy_models
from hardcount.times import database_now
from outbox import services as outbox_services

# Stripe test PaymentMethods (https://docs.stripe.com/testing): a card that charges, and one that
# attaches but declines every charge. localstripe knows both ids.
CARD_OK = "pm_card_visa"
CARD_DECLINES = "pm_card_chargeCustomerFail"
# A PaymentMethod id no gateway knows: the attach call answers 404, a gateway error (not a decline).
CARD_UNKNOWN_PREFIX = "pm_demo_unknown_"
# Nothing listens on the discard port: every delivery is refused at once (connection refused).
FAILING_WEBHOOK_URL = "http://127.0.0.1:9/hardcount-demo/always-down"

DECLINING_SHARE = 0.03
GATEWAY_FAILURE_SHARE = 0.01
TRIALING_SHARE = 0.08
CREDIT_SHARE = 0.05


@dataclass(frozen=True)
class DemoPrice:
    """A price of the demo catalogue: ``amount`` minor units of ``currency`` per ``interval``; ``weight``: its share."""

    nickname: str
    amount: int
    currency: str
    interval: str
    weight: int


PRICES: tuple[DemoPrice, ...] = (
    DemoPrice("Starter", 900, "usd", "month", 20),
    DemoPrice("Pro", 2900, "usd", "month", 14),
    DemoPrice("Pro yearly", 29000, "usd", "year", 6),
    DemoPrice("Meal box", 1499, "usd", "week", 8),
    DemoPrice("Basis", 800, "eur", "month", 14),
    DemoPrice("Plus", 2400, "eur", "month", 8),
    DemoPrice("Plus yearly", 24000, "eur", "year", 4),
    DemoPrice("Gemüsekiste", 1299, "eur", "week", 6),
    DemoPrice("Standard", 1200, "jpy", "month", 14),
    DemoPrice("Premium yearly", 12000, "jpy", "year", 6),
)

FIRST_NAMES = (
    "Ada", "Alan", "Amara", "Ana", "Aiko", "Ben", "Bea", "Carlos", "Chen", "Chloé", "Dara", "David", "Elif", "Emma",
    "Femi", "Grace", "Hana", "Hiro", "Ines", "Ivan", "Jana", "Jonas", "Kenji", "Lara", "Leon", "Lucía", "Maya",
    "Mateo", "Mia", "Noah", "Nora", "Omar", "Priya", "Ravi", "Rosa", "Sara", "Sofia", "Tariq", "Yuki", "Zoe",
)  # fmt: skip
LAST_NAMES = (
    "Abe", "Adeyemi", "Bauer", "Becker", "Costa", "Dubois", "Eriksen", "Fischer", "García", "Haddad", "Ito", "Jensen",
    "Kim", "Kowalski", "Lee", "Martin", "Müller", "Nakamura", "Novak", "Okafor", "Patel", "Rossi", "Sato", "Schmidt",
    "Silva", "Smith", "Suzuki", "Tanaka", "Weber", "Yamamoto",
)  # fmt: skip
EMAIL_DOMAINS = ("example.com", "example.org", "example.net")


@dataclass
class SeedSummary:
    """What :func:`seed_demo_book` wrote: counts by kind, for the command's report and the tests."""

    tenant_id: str
    subscriptions: int = 0
    due: int = 0
    trialing: int = 0
    declining_cards: int = 0
    failing_cards: int = 0
    # Of the subscriptions due now, those whose card declines / fails at the gateway.
    due_declining: int = 0
    due_failing: int = 0
    credit_balances: int = 0
    events: int = 0
    webhook_endpoints: list[str] = field(default_factory=list)
    by_price: dict[str, int] = field(default_factory=dict)


def _exact_share(rng: random.Random, n: int, share: float, *, besides: set[int] = frozenset()) -> set[int]:
    """``round(n × share)`` distinct indexes of ``range(n)`` not in ``besides`` (at least one when share and n > 0)."""
    pool = [i for i in range(n) if i not in besides]
    k = min(len(pool), max(1 if share > 0 and n else 0, round(n * share)))
    return set(rng.sample(pool, k))


def _latest_on_day(now: datetime, day: int, hour: int, minute: int, *, months_back: int = 0) -> datetime:
    """The latest instant not after ``now``, at least ``months_back`` months back, on ``day`` at ``hour:minute`` UTC.

    Months without that day (a 31st in April) are passed over, as a customer who signed up on
    the 31st would have.
    """
    year, month = now.year, now.month
    for _ in range(months_back):
        year, month = (year, month - 1) if month > 1 else (year - 1, 12)
    while True:
        if day <= calendar.monthrange(year, month)[1]:
            candidate = datetime(year, month, day, hour, minute, tzinfo=UTC)
            if candidate <= now:
                return candidate
        year, month = (year, month - 1) if month > 1 else (year - 1, 12)


def _anchor(rng: random.Random, price: DemoPrice, now: datetime, day: int) -> datetime:
    """A billing cycle anchor whose first period has begun by ``now`` (see the module docstring)."""
    if price.interval == "week":
        return (now - timedelta(minutes=rng.randint(1, 7 * 24 * 60 - 1))).replace(second=0, microsecond=0)
    hour, minute = rng.randint(0, 23), rng.choice((0, 15, 30, 45))
    months_back = rng.randint(0, 10) if price.interval == "year" else 0
    return _latest_on_day(now, day, hour, minute, months_back=months_back)


def ensure_webhook_endpoints(*, tenant_id: str, livemode: bool, webhook_url: str | None) -> list[str]:
    """The demo's webhook endpoints (all events): the working one at ``webhook_url`` and the failing one.

    An enabled endpoint of the tenant and mode with the same URL is reused, so seeding beside
    ``make run``'s registered receiver adds no second endpoint for it. Returns their ids.
    """
    wanted = [url for url in (webhook_url, FAILING_WEBHOOK_URL) if url]
    ids = []
    for url in wanted:
        existing = outbox_services.find_webhook_endpoint(tenant_id=tenant_id, livemode=livemode, url=url)
        if existing is None:
            description = "demo: always fails" if url == FAILING_WEBHOOK_URL else "demo: receiver"
            existing, _secret = outbox_services.create_webhook_endpoint(
                tenant_id=tenant_id, livemode=livemode, url=url, enabled_events=["*"], description=description
            )
        ids.append(existing.id)
    return ids


def seed_demo_book(
    *,
    tenant_id: str,
    subscriptions: int,
    seed: int = 0,
    now: datetime | None = None,
    webhook_url: str | None = None,
    livemode: bool = False,
) -> SeedSummary:
    """Write a demo book of ``subscriptions`` subscriptions for ``tenant_id`` in one transaction; returns its summary.

    ``seed`` drives every choice (names, prices, anchors, cards, credit), so the same
    ``(subscriptions, seed, now)`` gives the same book; ``now`` defaults to the database's
    ``now()``. ``webhook_url``: the working webhook endpoint (None: only the failing one is
    added). Test mode by default (the payment methods are Stripe test ids). Raises
    ``ValueError`` for a negative count.
    """
    if subscriptions < 0:
        raise ValueError("subscriptions must be >= 0")
    rng = random.Random(seed)
    summary = SeedSummary(tenant_id=tenant_id, subscriptions=subscriptions)
    with transaction.atomic():
        now = now or database_now()
        summary.webhook_endpoints = ensure_webhook_endpoints(
            tenant_id=tenant_id, livemode=livemode, webhook_url=webhook_url
        )
        events: list[tuple[str, dict, datetime | None]] = []

        prices = Price.objects.bulk_create(
            Price(
                tenant_id=tenant_id,
                livemode=livemode,
                nickname=p.nickname,
                amount=p.amount,
                currency=p.currency,
                interval=p.interval,
            )
            for p in PRICES
        )
        events += [("price.created", price_data(p), now) for p in prices]

        n = subscriptions
        declining = _exact_share(rng, n, DECLINING_SHARE)
        failing = _exact_share(rng, n, GATEWAY_FAILURE_SHARE, besides=declining)
        trialing = _exact_share(rng, n, TRIALING_SHARE)
        credited = sorted(_exact_share(rng, n, CREDIT_SHARE))
        # Day of the month for monthly and yearly anchors: every day 1..31 in turn, so a book of a few
        # hundred already has its 29th, 30th and 31st.
        days = [1 + i % 31 for i in range(n)]
        rng.shuffle(days)
        choices = rng.choices(range(len(PRICES)), weights=[p.weight for p in PRICES], k=n)

        customers: list[Customer] = []
        plans: list[tuple[int, datetime | None, datetime]] = []  # (price index, trial_end, anchor)
        for i in range(n):
            first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
            index = choices[i]
            demo_price = PRICES[index]
            if i in declining:
                card = CARD_DECLINES
            elif i in failing:
                card = f"{CARD_UNKNOWN_PREFIX}{i:06d}"
            else:
                card = CARD_OK
            local = f"{first}.{last}".lower().replace("é", "e").replace("í", "i").replace("ü", "ue")
            customers.append(
                Customer(
                    tenant_id=tenant_id,
                    livemode=livemode,
                    email=f"{local}.{i}@{rng.choice(EMAIL_DOMAINS)}",
                    name=f"{first} {last}",
                    external_id=f"demo-{i + 1:06d}",
                    default_payment_method=card,
                    currency=demo_price.currency,
                    metadata={"source": "seed_demo"},
                )
            )
            if i in trialing:
                trial_end = (now + timedelta(hours=rng.randint(24, 14 * 24))).replace(minute=0, second=0, microsecond=0)
                plans.append((index, trial_end, trial_end))
            else:
                plans.append((index, None, _anchor(rng, demo_price, now, days[i])))

        entries = []
        for i in credited:
            customer = customers[i]
            amount = PRICES[plans[i][0]].amount
            grant = amount * 3 if len(entries) % 2 == 0 else max(1, amount // 3)
            customer.credit_balance = grant
            entries.append(
                LedgerEntry(
                    tenant_id=tenant_id,
                    livemode=livemode,
                    customer=customer,
                    amount=grant,
                    currency=customer.currency,
                    balance_after=grant,
                    reason=LedgerEntry.GRANT,
                    description="demo: goodwill credit",
                    created_at=now,
                )
            )
        copy_models(Customer, customers)  # sets created_at on each
        copy_models(LedgerEntry, entries)
        # As created through the API: no balance yet (the grant is its own event, next).
        events += [("customer.created", {**customer_data(c), "credit_balance": 0}, now) for c in customers]
        events += [("customer.credit_granted", ledger_entry_data(e), now) for e in entries]

        subs = []
        for i, (index, trial_end, anchor) in enumerate(plans):
            subs.append(
                Subscription(
                    tenant_id=tenant_id,
                    livemode=livemode,
                    customer=customers[i],
                    price=prices[index],
                    status=Subscription.TRIALING if trial_end else Subscription.ACTIVE,
                    billing_cycle_anchor=anchor,
                    trial_end=trial_end,
                    current_period_start=now if trial_end else None,
                    current_period_end=trial_end,
                    next_billing_at=anchor,
                    metadata={"source": "seed_demo"},
                )
            )
            summary.by_price[PRICES[index].nickname] = summary.by_price.get(PRICES[index].nickname, 0) + 1
        copy_models(Subscription, subs)
        items = [
            SubscriptionItem(
                tenant_id=tenant_id, livemode=livemode, subscription=sub, price=sub.price, quantity=1, created_at=now
            )
            for sub in subs
        ]
        copy_models(SubscriptionItem, items)
        events += [
            ("subscription.created", subscription_data(s, items=[item]), now)
            for s, item in zip(subs, items, strict=True)
        ]
        summary.events = outbox_services.emit_events(events, tenant_id=tenant_id, livemode=livemode)

    summary.trialing = len(trialing)
    due_now = [i for i, s in enumerate(subs) if s.next_billing_at <= now]
    summary.due = len(due_now)
    summary.declining_cards = len(declining)
    summary.failing_cards = len(failing)
    summary.due_declining = sum(1 for i in due_now if i in declining)
    summary.due_failing = sum(1 for i in due_now if i in failing)
    summary.credit_balances = len(entries)
    return summary
