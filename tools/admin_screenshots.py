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

With ``--change-demo`` it then changes one paying subscription of the book through the console's
own actions, as an operator would (:data:`CHANGE_PAGES`): its quantity to 3 now (prorated: pending
invoice items), to 2 at the period's end (a scheduled change), and a pause of its collection for 20
days; and saves the quantity form, the subscription's page after them and its invoice items. This
writes to the book (each run takes the next paying subscription), so it is asked for by name.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

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


# What --change-demo saves: the quantity form, then the changed subscription's page and its invoice items.
CHANGE_PAGES = ("subscription-change-quantity.png", "subscription-changed.png", "invoice-items.png")
PAYING = "/admin/billing/subscription/?status__exact=active&billing_state=ok"
CONFIRM = "#content form input[type=submit]"


def _run_action(page, subscription_url: str, label: str, fields: dict[str, str], screenshot: Path | None = None):
    """Press the subscription page's ``label`` button, fill the confirmation form's ``fields`` and confirm it."""
    page.goto(subscription_url)
    page.click(f'.hc-object-actions input[value="{label}"]')
    page.wait_for_load_state("load")
    for name, value in fields.items():
        selector = f'[name="{name}"]'
        if page.eval_on_selector(selector, "e => e.tagName") == "SELECT":
            page.select_option(selector, value)
        else:
            page.fill(selector, value)
    if screenshot is not None:
        page.screenshot(path=str(screenshot), full_page=True)
    page.click(CONFIRM)
    page.wait_for_load_state("load")
    errors = page.query_selector(".messagelist .warning, .messagelist .error, .errorlist")
    if errors is not None:
        raise SystemExit(f"{label} on {subscription_url} was refused: {errors.inner_text()}")


def change_demo(page, base: str, out: Path) -> None:
    """Change the first paying subscription through the console (see the module's docstring) and save its pages."""
    target = _first_row(page, base, PAYING)
    if target is None:
        print("skipped the change pages: no paying subscription in this book", file=sys.stderr)
        return
    page.goto(target)
    item = page.eval_on_selector(".field-items_table td", "e => e.textContent.trim()")
    _run_action(
        page,
        target,
        "Change quantity",
        {"item": item, "quantity": "3", "proration_behavior": "create_prorations", "effective_at": "immediately"},
        screenshot=out / CHANGE_PAGES[0],
    )
    _run_action(
        page,
        target,
        "Change quantity",
        {"item": item, "quantity": "2", "proration_behavior": "create_prorations", "effective_at": "period_end"},
    )
    resumes_at = datetime.now(UTC) + timedelta(days=20)
    _run_action(
        page, target, "Pause collection", {"behavior": "keep_as_draft", "resumes_at": f"{resumes_at:%Y-%m-%d %H:%M}"}
    )
    page.goto(target)
    page.wait_for_load_state("load")
    page.screenshot(path=str(out / CHANGE_PAGES[1]), full_page=True)
    # The admin writes a primary key into its URLs with "_" and other characters as "_XX" (admin.utils.quote).
    quoted = urlsplit(target).path.rstrip("/").split("/")[-2]
    subscription_id = re.sub(r"_([0-9A-F]{2})", lambda m: chr(int(m[1], 16)), quoted)
    page.goto(f"{base}/admin/billing/invoiceitem/?subscription={subscription_id}")
    page.wait_for_load_state("load")
    page.screenshot(path=str(out / CHANGE_PAGES[2]), full_page=True)
    print(f"{', '.join(CHANGE_PAGES)}: {subscription_id} changed through the console — {target}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "admin")
    parser.add_argument("--user")
    parser.add_argument("--password")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument(
        "--change-demo",
        action="store_true",
        help="also change one paying subscription through the console's actions and save its pages (writes)",
    )
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
        if args.change_demo:
            change_demo(page, base, args.out)
        browser.close()
    for line in missing:
        print(f"skipped {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
