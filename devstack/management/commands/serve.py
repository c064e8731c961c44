"""``python manage.py serve``: the whole development stack in one command (what ``make run`` runs).

It starts, in order:

1. ``localstripe`` on a free port, persisting to ``var/localstripe.pickle``, and in front of it
   the strict dev Stripe (:mod:`devstack.strict_stripe`: Stripe's idempotency layer, keys kept
   ``HARDCOUNT_DEV_STRIPE_KEY_TTL_S`` seconds, 24 h by default, in ``var/idempotency.jsonl``),
   which is what ``STRIPE_API_BASE`` points at (both skipped when ``STRIPE_API_BASE`` is set, or
   ``STRIPE_API_KEY`` is a real key: then that gateway is used);
2. the demo tenant with a test and a live key, and the admin's ``operator`` superuser, both
   reused across restarts (plaintext kept in ``var/``, development only: see
   :mod:`devstack.demo`);
3. a local webhook receiver that logs each delivery (a sample while they arrive in bulk) and
   checks its signature;
4. gunicorn with ``hardcount/gunicorn.conf.py`` on ``127.0.0.1:$HARDCOUNT_PORT`` (8000), with
   ``HARDCOUNT_RUN_SCHEDULER=1`` so the scheduler runtime runs in the web workers; its lines go
   through :class:`devstack.stack.SchedulerLogView` (one short line per tick that did something;
   every line as it came with ``HARDCOUNT_LOG_LEVEL=DEBUG``), its access log only with
   ``HARDCOUNT_ACCESS_LOG=1``;

then registers the receiver as the demo tenant's webhook endpoint, prints where to go (the
keys, the test payment methods, the commands that bill a customer), and supervises. A
database error in the supervisor's own reads (the progress line) never stops the stack:
:class:`DatabaseRetry` closes the connection, says so once and retries with backoff. Ctrl-C
or SIGTERM stops gunicorn gracefully (its workers release their leases), then the receiver,
the strict dev Stripe and localstripe. The embedded PostgreSQL is left running for the next
command (``make stop-db`` stops it), as everywhere else
(docs/decisions/0131-dev-stack-resilience-and-first-run.md).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, DatabaseError, InterfaceError, connections
from django.db.migrations.executor import MigrationExecutor

from billing.gateway_accounts import PLATFORM_SLUG
from devstack import demo as demo_credentials
from devstack.seed import FAILING_WEBHOOK_URL
from devstack.stack import (
    ChildProcess,
    LocalStripe,
    SchedulerLogView,
    StrictStripeProcess,
    WebhookReceiver,
    port_is_free,
    start_gunicorn,
    start_localstripe,
    start_strict_stripe,
    wait_for_http,
)
from devstack.strict_stripe import DEFAULT_KEY_TTL_S, generate_webhook_secret

# The key settings fall back to when STRIPE_API_KEY is unset: it only ever talks to localstripe.
DEV_STRIPE_KEY = "sk_test_hardcount_localstripe"
DEFAULT_PORT = 8000
# How often the supervising loop looks at its children and asks for a progress line.
SUPERVISE_EVERY_S = 1.0
PROGRESS_EVERY_S = 5.0
# Development defaults for the children; any value set in the environment wins.
DEV_ENV_DEFAULTS = {"HARDCOUNT_BILLING_INTERVAL_S": "10", "PYTHONUNBUFFERED": "1"}
# HARDCOUNT_ACCESS_LOG=1: gunicorn's access log on the terminal too (one line per request).
ACCESS_LOG_ENV = "HARDCOUNT_ACCESS_LOG"
# Backoff of the supervisor's database reads after an error: 1 s, doubling, at most this.
DB_RETRY_MAX_S = 30.0
# Stripe's test PaymentMethods the dev Stripe knows (devstack/devstripe.py), as the banner and README list them.
TEST_PAYMENT_METHODS = (
    ("pm_card_visa", "charges"),
    ("pm_card_chargeDeclined", "declines (generic_decline): invoice open, past_due, dunning retries"),
    ("pm_card_chargeDeclinedInsufficientFunds", "declines (insufficient_funds)"),
    ("pm_card_chargeCustomerFail", "attaches, then every charge declines"),
    ("pm_card_authenticationRequired", "requires action (3-D Secure): invoice open, invoice.payment_action_required"),
    ("pm_unknown (any unknown id)", "fails at the gateway (404): no decline, the period waits on the retry ladder"),
)
# How long the strict dev Stripe remembers an idempotency key: Stripe's 24 hours unless set.
DEV_STRIPE_KEY_TTL_ENV = "HARDCOUNT_DEV_STRIPE_KEY_TTL_S"

T = TypeVar("T")


class Stopped(Exception):
    """Ctrl-C or SIGTERM arrived while the stack was starting."""


@dataclass
class ServeContext:
    """What is running, handed to the hooks (:meth:`Command.after_ready`, :meth:`Command.progress_line`)."""

    base_url: str
    stripe_api_base: str
    demo: demo_credentials.DemoTenant
    operator: tuple[str, str]
    receiver: WebhookReceiver
    gunicorn: ChildProcess
    localstripe: LocalStripe | None
    strict_stripe: StrictStripeProcess | None = None


def dev_stripe_key_ttl_s(environ=os.environ) -> float:
    """Seconds the strict dev Stripe remembers a key: ``HARDCOUNT_DEV_STRIPE_KEY_TTL_S``, default 24 h.

    Raises ``CommandError`` when the value is not a positive number.
    """
    raw = environ.get(DEV_STRIPE_KEY_TTL_ENV)
    if raw is None:
        return DEFAULT_KEY_TTL_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise CommandError(f"{DEV_STRIPE_KEY_TTL_ENV} must be a positive number of seconds, not {raw!r}")
    return value


def wants_localstripe(environ=os.environ) -> bool:
    """True unless ``STRIPE_API_BASE`` is set or ``STRIPE_API_KEY`` is a key other than the dev default."""
    if environ.get("STRIPE_API_BASE"):
        return False
    return environ.get("STRIPE_API_KEY", DEV_STRIPE_KEY) == DEV_STRIPE_KEY


class DatabaseRetry:
    """Runs the supervisor's database reads so that a database error never stops the stack.

    :meth:`call` runs ``fn()`` and returns its result. On a ``DatabaseError`` (a terminated
    session, a restarted server) it closes the broken connection (the next call opens a new
    one), says so once through ``write``, returns None and refuses further calls (None at once)
    for a backoff of 1 s, 2 s, 4 s … up to ``max_s``; the first call that succeeds again says so
    and resets the backoff.
    """

    def __init__(self, write: Callable[[str], None], *, max_s: float = DB_RETRY_MAX_S, clock=time.monotonic):
        self.write = write
        self.max_s = max_s
        self.clock = clock
        self.failures = 0
        self.failed_at: float | None = None
        self.retry_at = 0.0

    @property
    def failing(self) -> bool:
        """True from a failed call until one succeeds."""
        return self.failures > 0

    def call(self, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None when it raised ``DatabaseError`` (or ``InterfaceError``) or a backoff is running."""
        now = self.clock()
        if now < self.retry_at:
            return None
        try:
            result = fn()
        except (DatabaseError, InterfaceError) as exc:
            _close_quietly()
            self.failures += 1
            delay = min(self.max_s, 2.0 ** (self.failures - 1))
            self.retry_at = now + delay
            if self.failures == 1:
                self.failed_at = now
                detail = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
                self.write(
                    f"database: the supervisor's query failed ({type(exc).__name__}: {detail}); the stack keeps "
                    "serving, and serve retries with backoff (1 s, 2 s, 4 s … up to "
                    f"{self.max_s:.0f} s) without saying so again."
                )
            return None
        if self.failures:
            self.write(
                f"database: back after {now - (self.failed_at or now):.0f} s ({self.failures} failed "
                f"attempt{'s' if self.failures != 1 else ''}); progress lines resume."
            )
            self.failures, self.failed_at, self.retry_at = 0, None, 0.0
        return result


def _close_quietly() -> None:
    """Close the default connection after an error; closing a broken one may raise too."""
    try:
        connections[DEFAULT_DB_ALIAS].close()
    except (DatabaseError, InterfaceError):
        pass


class Command(BaseCommand):
    help = "Run the development stack: localstripe, the demo tenant, a webhook receiver and gunicorn."

    def add_arguments(self, parser):
        parser.add_argument(
            "--port",
            type=int,
            default=int(os.environ.get("HARDCOUNT_PORT", DEFAULT_PORT)),
            help="port on 127.0.0.1 for the API and admin (default: $HARDCOUNT_PORT or 8000)",
        )

    def handle(self, *args, **options):
        port = options["port"]
        if not port_is_free(port):
            raise CommandError(f"127.0.0.1:{port} is already in use. Set HARDCOUNT_PORT to another port.")
        var_dir = Path(settings.VAR_DIR)
        (var_dir / "log").mkdir(parents=True, exist_ok=True)
        self._apply_pending_migrations()

        stop = threading.Event()
        previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        localstripe = strict_stripe = gunicorn = receiver = None
        try:
            localstripe, strict_stripe, stripe_api_base = self._start_gateway(var_dir, port)
            demo = demo_credentials.ensure_demo_tenant(var_dir / "demo-keys.json")
            operator = demo_credentials.ensure_operator(var_dir / "operator.json")
            receiver = self._make_receiver(demo)
            # The receiver, and the demo book's always-down endpoint: allowed, so its deliveries are
            # really refused by a closed port (retries, then the circuit breaker), not by the policy.
            down = FAILING_WEBHOOK_URL.split("/")[2]
            os.environ["HARDCOUNT_OUTBOUND_ALLOW"] = (
                f"{os.environ.get('HARDCOUNT_OUTBOUND_ALLOW', '')},127.0.0.1:{receiver.port},{down}"
            )
            connections.close_all()  # this process only supervises from here on

            detail = os.environ.get("HARDCOUNT_LOG_LEVEL", "INFO").upper() == "DEBUG"
            gunicorn = start_gunicorn(
                base_dir=Path(settings.BASE_DIR),
                bind=f"127.0.0.1:{port}",
                env=self._child_env(port, stripe_api_base),
                access_log=os.environ.get(ACCESS_LOG_ENV) == "1",
                output=SchedulerLogView(self._write_line, detail=detail),
            )
            receiver.start()
            base_url = f"http://127.0.0.1:{port}"
            try:
                wait_for_http(
                    f"{base_url}/health/live", timeout_s=60, alive=lambda: gunicorn.poll() is None and not stop.is_set()
                )
            except RuntimeError:
                if stop.is_set():
                    raise Stopped from None
                raise CommandError("gunicorn exited during start-up; its log is above.") from None
            ctx = ServeContext(
                base_url, stripe_api_base, demo, operator, receiver, gunicorn, localstripe, strict_stripe
            )
            self._register_webhook_endpoints(ctx, var_dir / "demo-keys.json")
            self.after_ready(ctx)
            self._print_banner(ctx, var_dir)
            self._supervise(ctx, stop)
        except Stopped:
            pass
        finally:
            # A second Ctrl-C while stopping: no more waiting for in-flight work.
            children = [
                c
                for c in (gunicorn, strict_stripe and strict_stripe.child, localstripe and localstripe.child)
                if c is not None
            ]
            for sig in previous:
                signal.signal(sig, lambda *_: [c.kill() for c in children])
            self._stop(gunicorn, receiver, localstripe, strict_stripe)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # --- hooks ----------------------------------------------------------------------------------------------------

    def after_ready(self, ctx: ServeContext) -> None:
        """Hook: runs once the API answers and before the banner is printed.

        Seeds the demo book on first start (``HARDCOUNT_DEMO_SUBSCRIPTIONS``, default 2,000;
        :mod:`devstack.demo_progress`), its working webhook endpoint being the local receiver
        (which samples while deliveries arrive in bulk; the progress line counts them all).
        """
        from devstack.demo_progress import DemoWatch

        username, password = ctx.operator
        self._demo_watch = DemoWatch(
            ctx.demo.tenant_id,
            write=self.stdout.write,
            done_lines=lambda: [f"  admin          {ctx.base_url}/admin/   login: {username} / {password}"],
        )
        self._demo_watch.start(webhook_url=ctx.receiver.url)

    def progress_line(self, ctx: ServeContext) -> str | None:
        """Hook: called every ``PROGRESS_EVERY_S`` seconds while serving; a returned line is printed.

        The demo book's line (due, billed, failed, parked, deliveries) until the first drain has
        ended, then that drain's summary with the admin URL and login; afterwards a line only
        when something changed. A ``DatabaseError`` raised here is retried by the supervisor.
        """
        watch = getattr(self, "_demo_watch", None)
        return watch.line() if watch is not None else None

    # --- steps ----------------------------------------------------------------------------------------------------

    def _apply_pending_migrations(self) -> None:
        connection = connections[DEFAULT_DB_ALIAS]
        executor = MigrationExecutor(connection)
        if executor.migration_plan(executor.loader.graph.leaf_nodes()):
            self.stdout.write("Applying migrations…")
            call_command("migrate", interactive=False, verbosity=0)

    def _start_gateway(self, var_dir: Path, port: int) -> tuple[LocalStripe | None, StrictStripeProcess | None, str]:
        if not wants_localstripe():
            base = os.environ.get("STRIPE_API_BASE") or "https://api.stripe.com"
            if settings.STRIPE_API_KEY.startswith(("sk_live_", "rk_live_")):
                self.stderr.write(self.style.WARNING("STRIPE_API_KEY is a live key: charges will be real."))
            return None, None, base
        key_ttl_s = dev_stripe_key_ttl_s()
        store_path, keys_path = var_dir / "localstripe.pickle", var_dir / "idempotency.jsonl"
        if not store_path.exists():
            # The keys name localstripe's objects: a fresh localstripe starts with no keys either.
            keys_path.unlink(missing_ok=True)
        localstripe = start_localstripe(
            store_path=store_path, log_path=var_dir / "log" / "localstripe.log", api_key=settings.STRIPE_API_KEY
        )
        # The dev Stripe's webhook endpoint is the product's platform URL; both sides get one secret per start
        # (the product through its environment, which gunicorn inherits) unless STRIPE_WEBHOOK_SECRET is set.
        webhook_secret = os.environ.get("STRIPE_WEBHOOK_SECRET") or generate_webhook_secret()
        os.environ["STRIPE_WEBHOOK_SECRET"] = settings.STRIPE_WEBHOOK_SECRET = webhook_secret
        try:
            strict = start_strict_stripe(
                upstream=localstripe.api_base,
                store_path=keys_path,
                key_ttl_s=key_ttl_s,
                log_path=var_dir / "log" / "strict-stripe.log",
                api_key=settings.STRIPE_API_KEY,
                webhook_url=f"http://127.0.0.1:{port}/stripe/webhooks/{PLATFORM_SLUG}",
                webhook_secret=webhook_secret,
            )
        except Exception:
            localstripe.stop()
            raise
        # For the children (gunicorn inherits it) and for this process's hooks: every charge goes
        # through the strict dev Stripe, never to localstripe directly.
        os.environ["STRIPE_API_BASE"] = strict.api_base
        settings.STRIPE_API_BASE = strict.api_base
        return localstripe, strict, strict.api_base

    def _make_receiver(self, demo: demo_credentials.DemoTenant) -> WebhookReceiver:
        saved_port = demo.extra.get("webhook_receiver_port")
        port = saved_port if isinstance(saved_port, int) and port_is_free(saved_port) else 0

        def secrets():
            return [e["secret"] for e in (demo.extra.get("webhook_endpoints") or {}).values() if "secret" in e]

        return WebhookReceiver(port=port, secrets=secrets, log=self.stdout.write)

    def _child_env(self, port: int, stripe_api_base: str) -> dict[str, str]:
        env = {**DEV_ENV_DEFAULTS, **os.environ}
        env.update(
            DJANGO_SETTINGS_MODULE="hardcount.settings",
            HARDCOUNT_PORT=str(port),
            HARDCOUNT_RUN_SCHEDULER="1",
            STRIPE_API_BASE=stripe_api_base if stripe_api_base != "https://api.stripe.com" else "",
        )
        return env

    def _register_webhook_endpoints(self, ctx: ServeContext, keys_path: Path) -> None:
        """Point a test-mode webhook endpoint (subscribed to ``*``) at the local receiver, through the API.

        Reuses the endpoint saved in ``demo-keys.json`` while it exists and its URL is the
        receiver's; otherwise creates one (and deletes the stale one). When the webhook
        endpoints API refuses (404: not built yet), says so and carries on without that endpoint.
        """
        demo = ctx.demo
        saved = dict(demo.extra.get("webhook_endpoints") or {})
        # Test mode only: live-mode endpoints must be https:// (outbox's rule), and the receiver is plain http.
        for mode, key in (("test", demo.test_key),):
            old = saved.get(mode) or {}
            if (
                old.get("url") == ctx.receiver.url
                and _api(ctx.base_url, key, "GET", f"/v1/webhook_endpoints/{old.get('id')}")[0] == 200
            ):
                continue
            status, body = _api(
                ctx.base_url,
                key,
                "POST",
                "/v1/webhook_endpoints",
                {"url": ctx.receiver.url, "enabled_events": ["*"], "description": "make run: local receiver"},
            )
            if status not in (200, 201) or not isinstance(body, dict) or "secret" not in body:
                message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
                self.stdout.write(
                    f"(no {mode}-mode webhook endpoint: POST /v1/webhook_endpoints answered {status} {message})"
                )
                continue
            if old.get("id"):
                _api(ctx.base_url, key, "DELETE", f"/v1/webhook_endpoints/{old['id']}")
            saved[mode] = {"id": body["id"], "url": ctx.receiver.url, "secret": body["secret"]}
        demo.extra["webhook_endpoints"] = saved
        demo.extra["webhook_receiver_port"] = ctx.receiver.port
        demo_credentials.save_demo_tenant(keys_path, demo)

    def _print_banner(self, ctx: ServeContext, var_dir: Path) -> None:
        username, password = ctx.operator
        demo = ctx.demo
        if ctx.localstripe and ctx.strict_stripe:
            proxy = ctx.strict_stripe
            gateway = (
                f"strict dev Stripe at {proxy.api_base} (idempotency keys kept {_duration(proxy.key_ttl_s)} in "
                f"{proxy.store_path}, log {var_dir / 'log' / 'strict-stripe.log'})\n"
                f"                 in front of localstripe at {ctx.localstripe.api_base} (store "
                f"{var_dir / 'localstripe.pickle'}, log {var_dir / 'log' / 'localstripe.log'})"
            )
        else:
            gateway = ctx.stripe_api_base
        database = (
            "DATABASE_URL"
            if os.environ.get("DATABASE_URL")
            else f"embedded PostgreSQL in {var_dir / 'pgdata'} (left running on exit; `make stop-db` stops it)"
        )
        hooked = " and ".join(
            f"{mode} mode ({e['id']})"
            for mode, e in (demo.extra.get("webhook_endpoints") or {}).items()
            if e.get("url") == ctx.receiver.url
        )
        lines = [
            "",
            self.style.SUCCESS("Hardcount is running.") + " Ctrl-C stops it.",
            "",
            f"  API            {ctx.base_url}/v1/",
            f"  test key       {demo.test_key}",
            f"  live key       {demo.live_key}",
            f"                 demo tenant {demo.tenant_id}; keys kept in {var_dir / 'demo-keys.json'} (dev only)",
            f"  admin          {ctx.base_url}/admin/   login: {username} / {password}",
            f"  health         {ctx.base_url}/health/ready",
            f"  metrics        {ctx.base_url}/metrics",
            f"  gateway        {gateway}",
            f"  doctor         STRIPE_API_BASE={ctx.stripe_api_base} python manage.py doctor --gateway",
            f"  webhooks       {ctx.receiver.url} logs each delivery below (sampled while they arrive in bulk: one",
            f"                 summary line per 5 s); endpoint for {hooked or 'no mode'}",
        ]
        if self._has_always_down_endpoint(demo.tenant_id):
            lines += [
                f"  always-down    {FAILING_WEBHOOK_URL}: the demo book's second endpoint.",
                "                 Nothing listens there, on purpose: its deliveries stay pending to show retries and",
                "                 the circuit breaker (docs/decisions/0032); the progress line counts them apart.",
            ]
        lines += [
            f"  database       {database}",
            "",
            "  Test payment methods (a customer's default_payment_method; Stripe's test ids, known to the dev Stripe):",
            "",
            *(f"    {pm:<40} {what}" for pm, what in TEST_PAYMENT_METHODS),
            "",
            "  Bill a customer (test mode, bash; the billing loop bills a new subscription within 10 s):",
            "",
            *(f"    {command}" for command in banner_commands(ctx.base_url, demo.test_key)),
            "",
        ]
        self.stdout.write("\n".join(lines))
        self.stdout.flush()

    def _has_always_down_endpoint(self, tenant_id: str) -> bool:
        from outbox.models import WebhookEndpoint

        try:
            return WebhookEndpoint.objects.filter(
                tenant_id=tenant_id, livemode=False, url=FAILING_WEBHOOK_URL, deleted_at__isnull=True
            ).exists()
        except (DatabaseError, InterfaceError):
            _close_quietly()
            return False

    def _supervise(self, ctx: ServeContext, stop: threading.Event) -> None:
        database = DatabaseRetry(self._write_line)
        waited = 0.0
        while not stop.wait(SUPERVISE_EVERY_S):
            if ctx.gunicorn.poll() is not None:
                raise CommandError(f"gunicorn exited with code {ctx.gunicorn.poll()}; stopping.")
            if ctx.localstripe and ctx.localstripe.child.poll() is not None:
                raise CommandError(f"localstripe exited with code {ctx.localstripe.child.poll()}; stopping.")
            if ctx.strict_stripe and ctx.strict_stripe.child.poll() is not None:
                raise CommandError(
                    f"the strict dev Stripe exited with code {ctx.strict_stripe.child.poll()}; stopping."
                )
            ctx.receiver.flush()
            waited += SUPERVISE_EVERY_S
            # While the database fails, every supervise step may retry (the backoff spaces them).
            if waited >= PROGRESS_EVERY_S or database.failing:
                waited = 0.0
                line = database.call(lambda: self.progress_line(ctx))
                if line:
                    self._write_line(line)
        self.stdout.write("Stopping… (Ctrl-C again to kill at once)")

    def _write_line(self, line: str) -> None:
        """Write one line (or several joined by newlines) at once, from any thread."""
        self.stdout.write(line)
        self.stdout.flush()

    def _stop(self, gunicorn, receiver, localstripe, strict_stripe=None) -> None:
        # gunicorn first: its workers may still be charging through the strict dev Stripe; then the
        # proxy, so nothing reaches localstripe after the proxy stopped storing keys.
        if gunicorn is not None:
            graceful_s = float(os.environ.get("HARDCOUNT_GRACEFUL_TIMEOUT_S", "15"))
            gunicorn.stop(graceful_s + 5)
            if gunicorn.output_thread is not None:
                gunicorn.output_thread.join(5)  # its last lines (the workers' shutdown) come before ours
        if receiver is not None:
            receiver.stop()
        if strict_stripe is not None:
            strict_stripe.stop()
        if localstripe is not None:
            localstripe.stop()
        if gunicorn is not None:
            self.stdout.write("Stopped gunicorn" + (" and localstripe." if localstripe else "."))


def banner_commands(base_url: str, test_key: str) -> list[str]:
    """The banner's shell commands: a customer with ``pm_card_visa``, a price, a subscription, then its invoice.

    Plain bash with curl and python3 (``make run`` needs nothing else); the system test runs them as printed.
    """
    return [
        f'API={base_url}/v1 AUTH="Authorization: Bearer {test_key}"',
        r'post() { curl -sS -X POST "$API/$1" -H "$AUTH" -H "Content-Type: application/json" -d "$2"; }',
        r"""field() { python3 -c "import json, sys; d = json.load(sys.stdin); print(d.get('$1', d))"; }""",
        r"""CUS=$(post customers '{"email": "jenny@example.com", "default_payment_method": "pm_card_visa"}' """
        r"""| field id)""",
        r"""PRICE=$(post prices '{"amount": 2000, "currency": "usd", "interval": "month"}' | field id)""",
        r'SUB=$(post subscriptions "{\"customer\": \"$CUS\", \"price\": \"$PRICE\"}" | field id)',
        r'echo "$CUS $PRICE $SUB"',
        r"""for _ in $(seq 60); do curl -sS "$API/invoices?subscription=$SUB" -H "$AUTH" """
        r"""| grep -q '"status":"paid"' && break; sleep 1; done""",
        r'curl -sS "$API/subscriptions/$SUB" -H "$AUTH" | field status             # active',
        r'curl -sS "$API/invoices?subscription=$SUB" -H "$AUTH"; echo              # one invoice, "status": "paid"',
    ]


def _duration(seconds: float) -> str:
    """``24 h``, ``90 s``: a key TTL as the banner shows it."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    return f"{seconds:g} s"


def _api(base_url: str, key: str, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
    """One JSON request to the API; returns ``(status, parsed body or None)``, 0 when unreachable."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(  # noqa: S310 (http to localhost)
        base_url + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, None
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None
