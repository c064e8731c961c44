"""The strict dev Stripe (``devstack/strict_stripe.py``): replay, body mismatch, key TTL, the key file, the CLI.

Each test runs its own proxy in front of the session's localstripe (``localstripe_base``); the
gateway-level negative control shows why ``make run`` needs it: an unknown attempt re-sent under
its key is one PaymentIntent through the proxy and two straight to localstripe.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
import uuid

import pytest
import stripe

from billing.gateway import SUCCEEDED, UNKNOWN, ChargeRequest, Gateway
from devstack.stack import start_strict_stripe
from devstack.strict_stripe import KeyFile, StrictStripe
from tests.billing.conftest import STRIPE_KEY, localstripe_base, stripe_client  # noqa: F401 - fixtures

# stripe's HTTPX client passes bytes as data=; httpx warns on every request.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


class Clock:
    """Wall-clock seconds that move only when told (the proxy's key TTL)."""

    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def post(base: str, path: str, params: dict[str, str], key: str | None) -> tuple[int, dict, dict]:
    """A form POST as the stripe library sends it: ``(status, headers, body)``."""
    request = urllib.request.Request(
        base + path,
        data="&".join(f"{k}={v}" for k, v in params.items()).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {STRIPE_KEY}", **({"Idempotency-Key": key} if key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


@pytest.fixture
def strict(localstripe_base):  # noqa: F811 - the fixture imported above
    """A factory of proxies in front of the session's localstripe; each is stopped at the end."""
    made: list[StrictStripe] = []

    def make(**kwargs) -> StrictStripe:
        made.append(StrictStripe(localstripe_base, **kwargs).start())
        return made[-1]

    yield make
    for proxy in made:
        proxy.stop()


def test_a_same_key_request_is_replayed_and_marked(strict):
    proxy = strict()
    status, headers, first = post(proxy.api_base, "/v1/customers", {"email": "a@example.com"}, "k-replay")
    again_status, again_headers, again = post(proxy.api_base, "/v1/customers", {"email": "a@example.com"}, "k-replay")

    assert (status, again_status) == (200, 200)
    assert again["id"] == first["id"]
    assert "Idempotent-Replayed" not in headers
    assert again_headers["Idempotent-Replayed"] == "true"
    assert [e.action for e in proxy.entries("POST /v1/customers")] == ["forwarded", "replayed"]


def test_a_different_body_under_a_live_key_is_an_idempotency_error(strict):
    proxy = strict()
    post(proxy.api_base, "/v1/customers", {"email": "a@example.com"}, "k-mismatch")
    status, _, body = post(proxy.api_base, "/v1/customers", {"email": "b@example.com"}, "k-mismatch")

    assert status == 400
    assert body["error"]["type"] == "idempotency_error"
    assert len(proxy.entries("POST /v1/customers", action="forwarded")) == 1


def test_after_the_ttl_a_same_key_request_runs_again(strict):
    clock = Clock()
    proxy = strict(key_ttl_s=60, clock=clock)
    _, _, first = post(proxy.api_base, "/v1/customers", {"email": "a@example.com"}, "k-ttl")
    clock.now += 59.9
    _, headers, replay = post(proxy.api_base, "/v1/customers", {"email": "a@example.com"}, "k-ttl")
    clock.now += 0.1  # 60 s after the key was first seen: pruned, as Stripe prunes it after 24 h
    _, after_headers, second = post(proxy.api_base, "/v1/customers", {"email": "a@example.com"}, "k-ttl")

    assert replay["id"] == first["id"] and headers["Idempotent-Replayed"] == "true"
    assert second["id"] != first["id"]
    assert "Idempotent-Replayed" not in after_headers
    # The new request's key lives from now on; a different body under it is refused again.
    assert post(proxy.api_base, "/v1/customers", {"email": "b@example.com"}, "k-ttl")[0] == 400
    assert proxy.stored_keys()["k-ttl"] == clock.now


def test_the_default_ttl_is_stripes_24_hours(strict):
    assert strict().key_ttl_s == 24 * 3600


def test_the_key_file_replays_after_a_restart_and_drops_expired_keys(strict, tmp_path):
    clock = Clock()
    path = tmp_path / "idempotency.jsonl"
    first = strict(store_path=path, key_ttl_s=3600, clock=clock)
    _, _, old = post(first.api_base, "/v1/customers", {"email": "old@example.com"}, "k-old")
    clock.now += 1800
    _, _, new = post(first.api_base, "/v1/customers", {"email": "new@example.com"}, "k-new")
    first.stop()

    clock.now += 1800  # k-old is an hour old now, k-new half an hour
    second = strict(store_path=path, key_ttl_s=3600, clock=clock)
    _, headers, replay = post(second.api_base, "/v1/customers", {"email": "new@example.com"}, "k-new")
    _, _, rerun = post(second.api_base, "/v1/customers", {"email": "old@example.com"}, "k-old")

    assert replay["id"] == new["id"] and headers["Idempotent-Replayed"] == "true"
    assert rerun["id"] != old["id"]
    keys = [json.loads(line)["key"] for line in path.read_text().splitlines()]
    assert keys == ["k-new", "k-old"]  # compacted on load: the expired k-old line is gone, its rerun appended


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "idempotency.jsonl"
    path.write_text('{"key": "k", "first_seen": 1, "fingerprint": "f", "status": 200, "content_type"')
    store = KeyFile(path)
    assert store.load(now=2, ttl_s=60) == {}
    store.close()
    assert path.read_text() == ""


def test_the_cli_keeps_every_answered_key_across_a_sigkill(localstripe_base, tmp_path):  # noqa: F811
    path = tmp_path / "idempotency.jsonl"
    proxy = start_strict_stripe(upstream=localstripe_base, store_path=path, key_ttl_s=3600, api_key=STRIPE_KEY)
    try:
        _, _, first = post(proxy.api_base, "/v1/customers", {"email": "a@example.com"}, "k-cli")
        os.kill(proxy.child.pid, signal.SIGKILL)
        proxy.child.process.wait(10)
    finally:
        proxy.stop()
    proxy = start_strict_stripe(upstream=localstripe_base, store_path=path, key_ttl_s=3600, api_key=STRIPE_KEY)
    try:
        _, headers, replay = post(proxy.api_base, "/v1/customers", {"email": "a@example.com"}, "k-cli")
    finally:
        assert proxy.stop() == 0  # SIGTERM is a clean exit
    assert replay["id"] == first["id"] and headers["Idempotent-Replayed"] == "true"


def _unknown_attempt_resent(gateway: Gateway, customer: str, invoice_id: str, *, lose_first_answer) -> list[str]:
    """Charge ``invoice_id`` once with its answer lost, then re-send under the same key; the ids seen."""
    req = ChargeRequest(
        invoice_id=invoice_id,
        customer_id="cus_hardcount",
        customer_email="a@example.com",
        customer_name="",
        gateway_customer_id=customer,
        payment_method="pm_card_visa",
        attach_payment_method=False,
        amount=1234,
        currency="usd",
        idempotency_key=f"hc:{invoice_id}:create",
    )
    first = lose_first_answer(req)
    second = gateway.charge(req)
    assert second.outcome == SUCCEEDED
    return [first, second.payment_intent_id]


def _succeeded_intents(client: stripe.StripeClient, invoice_id: str) -> list[str]:
    return [
        pi.id
        for pi in client.v1.payment_intents.list(params={"limit": 100}).auto_paging_iter()
        if (pi.metadata.to_dict() if pi.metadata else {}).get("hardcount_invoice") == invoice_id
        and pi.status == "succeeded"
    ]


def test_negative_control_an_unknown_attempt_resent_is_one_intent_only_through_the_proxy(
    strict,
    localstripe_base,  # noqa: F811
    stripe_client,  # noqa: F811
):
    customer = stripe_client.v1.customers.create(params={"email": "a@example.com"}).id
    proxy = strict()
    through = Gateway(api_key=STRIPE_KEY, api_base=proxy.api_base, timeout_s=2)
    bare = Gateway(api_key=STRIPE_KEY, api_base=localstripe_base, timeout_s=2)

    def reset_after_forward(req):
        proxy.fail_next("reset", match="POST /v1/payment_intents")
        result = through.charge(req)
        assert result.outcome == UNKNOWN  # charged at localstripe, the answer lost
        return ""

    def answer_dropped(req):
        # The caller died after localstripe answered: the same request, its answer never recorded.
        return bare.charge(req).payment_intent_id

    proxied, direct = f"in_proxied_{uuid.uuid4().hex}", f"in_bare_{uuid.uuid4().hex}"
    _unknown_attempt_resent(through, customer, proxied, lose_first_answer=reset_after_forward)
    _unknown_attempt_resent(bare, customer, direct, lose_first_answer=answer_dropped)

    assert len(_succeeded_intents(stripe_client, proxied)) == 1
    assert len(_succeeded_intents(stripe_client, direct)) == 2


def test_serve_takes_the_key_ttl_from_the_environment():
    from django.core.management.base import CommandError

    from devstack.management.commands.serve import dev_stripe_key_ttl_s

    assert dev_stripe_key_ttl_s({}) == 24 * 3600
    assert dev_stripe_key_ttl_s({"HARDCOUNT_DEV_STRIPE_KEY_TTL_S": "90"}) == 90
    for bad in ("0", "-1", "soon"):
        with pytest.raises(CommandError):
            dev_stripe_key_ttl_s({"HARDCOUNT_DEV_STRIPE_KEY_TTL_S": bad})


# --- accounts: who created an object, who may see it (docs/decisions/0132) --------------------------------------


def _client(base: str, key: str, stripe_account: str | None = None) -> stripe.StripeClient:
    return stripe.StripeClient(key, stripe_account=stripe_account, base_addresses={"api": base}, max_network_retries=0)


def test_objects_belong_to_the_account_that_created_them(strict):
    proxy = strict()
    mine, other = "sk_test_ownerAaaaaaaaaaaaaaaaa01", "sk_test_strangerBbbbbbbbbbbbbb02"
    customer = _client(proxy.api_base, mine).v1.customers.create(params={"email": "own@example.com"})
    connected = _client(proxy.api_base, STRIPE_KEY, "acct_1Connected000001").v1.customers.create(
        params={"email": "own@example.com"}
    )
    assert proxy.owner_of(customer.id) == mine
    assert proxy.owner_of(connected.id) == "acct_1Connected000001"  # Stripe-Account, not the platform key

    assert _client(proxy.api_base, mine).v1.customers.retrieve(customer.id).id == customer.id
    for key, account in ((other, None), (STRIPE_KEY, None), (mine, "acct_1Connected000001")):
        with pytest.raises(stripe.InvalidRequestError) as caught:
            _client(proxy.api_base, key, account).v1.customers.retrieve(customer.id)
        assert (caught.value.http_status, caught.value.code) == (404, "resource_missing")
        assert f"No such customer: '{customer.id}'" in str(caught.value)
    # Named in a body or a query, too; and lists leave other accounts' objects out.
    with pytest.raises(stripe.InvalidRequestError):
        _client(proxy.api_base, other).v1.payment_intents.create(
            params={"amount": 1000, "currency": "usd", "customer": customer.id}
        )
    listed = {c.id for c in _client(proxy.api_base, other).v1.customers.list(params={"email": "own@example.com"})}
    assert customer.id not in listed and connected.id not in listed
    mine_listed = {c.id for c in _client(proxy.api_base, mine).v1.customers.list(params={"email": "own@example.com"})}
    assert customer.id in mine_listed and connected.id not in mine_listed
    assert len(proxy.entries(action="foreign")) == 4  # refused before localstripe saw them


def test_an_injected_429_carries_retry_after_and_can_be_aimed_at_one_account(strict):
    proxy = strict()
    stormy = "sk_test_stormyAaaaaaaaaaaaaaaaa01"
    proxy.fail_next("429", times=5, account=stormy, retry_after_s=7)
    with pytest.raises(stripe.RateLimitError) as caught:
        _client(proxy.api_base, stormy).v1.customers.create(params={"email": "a@example.com"})
    assert caught.value.http_status == 429 and caught.value.headers.get("Retry-After") == "7"
    assert _client(proxy.api_base, STRIPE_KEY).v1.customers.create(params={"email": "b@example.com"}).id
    assert [e.request.account for e in proxy.entries(action="429")] == [stormy]
    proxy.clear()
    proxy.fail_next("429", retry_after_s=None)
    status, headers, _body = post(proxy.api_base, "/v1/customers", {"email": "c@example.com"}, None)
    assert status == 429 and "Retry-After" not in headers


def test_an_amount_over_stripes_eight_digits_is_refused_before_it_runs_and_its_key_stores_nothing(strict):
    proxy = strict()
    body = {"amount": "100000000", "currency": "usd", "payment_method_types[]": "card"}

    status, _, refused = post(proxy.api_base, "/v1/payment_intents", body, "k-too-large")
    assert (status, refused["error"]["code"], refused["error"]["param"]) == (400, "amount_too_large", "amount")
    # Not run, so not stored: the same key with a valid body runs (Stripe saves no result for a refused one).
    status, _, intent = post(proxy.api_base, "/v1/payment_intents", {**body, "amount": "99999999"}, "k-too-large")

    assert (status, intent["amount"]) == (200, 99999999)
    assert [e.action for e in proxy.entries("POST /v1/payment_intents")] == ["refused", "forwarded"]
