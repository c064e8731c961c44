"""Screenshots of the operators' console at 1440 px, for docs/admin/ (not part of ``make test``).

Usage, against a running ``make run`` stack (its operator login is in ``var/operator.json``)::

    .venv/bin/python tools/admin_screenshots.py [--base http://127.0.0.1:8000] [--out docs/admin]
        [--user operator --password …] [--chromium /usr/bin/chromium]

It drives Debian's Chromium (``apt-get install -y chromium``) headless through Playwright's
Python package (``pip install playwright``; its own browser download, ``playwright install``, is
never used), logs in through the admin's login form, finds the pages by the console's own list
filters (a parked subscription, a paying one, an open invoice, an endpoint whose circuit is open)
and saves one full-page PNG of each, 1440 px wide. A page it cannot find (no parked subscription
in this book yet) is reported and skipped. Chromium runs with networking features off and talks
only to ``--base``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 1440, 1000
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# (file name, what it shows, list URL whose first row is the page, a second list to try when the first is empty,
# and a link on that row's page to follow to the page shown). Lists in LISTS are shown themselves.
PAGES = [
    ("dashboard.png", "the dashboard", "/admin/", None),
    (
        "invoice-in-dunning.png",
        "an invoice in dunning (through its dunning run)",
        "/admin/dunning/dunningrun/?status__exact=active",
        None,
        ".field-invoice a",
    ),
    ("dunning-run.png", "an active dunning run", "/admin/dunning/dunningrun/?status__exact=active", None),
    (
        "subscription-failed.png",
        "a subscription that failed (parked, or else waiting)",
        "/admin/billing/subscription/?billing_state=parked",
        "/admin/billing/subscription/?billing_state=waiting",
    ),
    (
        "subscription-paying.png",
        "a paying subscription",
        "/admin/billing/subscription/?status__exact=active&billing_state=ok",
        None,
    ),
    ("invoice.png", "an open invoice (declined, in dunning)", "/admin/billing/invoice/?status__exact=open", None),
    ("invoice-paid.png", "a paid invoice", "/admin/billing/invoice/?status__exact=paid", None),
    ("deliveries.png", "the deliveries list", "/admin/outbox/delivery/", None),
    (
        "endpoint-circuit-open.png",
        "an endpoint with an open circuit",
        "/admin/outbox/webhookendpoint/?circuit=open",
        None,
    ),
    ("subscriptions.png", "the subscriptions list", "/admin/billing/subscription/", None),
    ("invoices.png", "the invoices list", "/admin/billing/invoice/", None),
    ("billing-runs.png", "the billing runs list (empty runs folded)", "/admin/billing/billingrun/", None),
]
LISTS = {"dashboard.png", "deliveries.png", "subscriptions.png", "invoices.png", "billing-runs.png"}


def _login(page, base: str, user: str, password: str) -> None:
    page.goto(f"{base}/admin/login/?next=/admin/")
    page.fill("#id_username", user)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    page.wait_for_load_state()
    if "/admin/login/" in page.url:
        raise SystemExit(f"login as {user!r} failed at {base}")


def _first_row(page, base: str, url: str) -> str | None:
    """The change page of the first row of the list at ``url``, or None when the list is empty."""
    page.goto(base + url)
    link = page.query_selector("#result_list tbody tr th a, #result_list tbody tr td.field-id a")
    return None if link is None else base + link.get_attribute("href")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "admin")
    parser.add_argument("--user")
    parser.add_argument("--password")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args(argv)
    user, password = args.user, args.password
    if not (user and password):
        login = json.loads((ROOT / "var" / "operator.json").read_text())
        user, password = login["username"], login["password"]
    base = args.base.rstrip("/")
    args.out.mkdir(parents=True, exist_ok=True)

    from playwright.sync_api import sync_playwright

    missing = []
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            profile,
            executable_path=args.chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": WIDTH, "height": HEIGHT},
        )
        page = browser.new_page()
        page.set_default_timeout(120_000)  # a busy 2-core stack answers slowly, not never
        _login(page, base, user, password)
        for name, what, url, fallback, *follow in PAGES:
            target = base + url if name in LISTS else _first_row(page, base, url)
            if target is None and fallback:
                target = _first_row(page, base, fallback)
            if target is not None and follow:
                page.goto(target)
                link = page.query_selector(follow[0])
                target = None if link is None else base + link.get_attribute("href")
            if target is None:
                missing.append(f"{name}: no {what} in this book")
                continue
            page.goto(target)
            page.wait_for_load_state("load")
            page.screenshot(path=str(args.out / name), full_page=True)
            print(f"{name}: {what} — {target}")
        browser.close()
    for line in missing:
        print(f"skipped {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
