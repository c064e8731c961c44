"""Every import from one app into another, listed with its reason.

The layers contract in ``pyproject.toml`` (import-linter, run by ``make lint``) says which way an
import may point: ``devstack | ops`` > ``billing`` > ``dunning`` > ``outbox`` > ``leases`` >
``hardcount``. This test says which of the permitted edges exist and why: an edge the code gains
fails until it is listed here with a reason, and a listed edge the code no longer has fails until
its entry is removed, so the list can never drift from the code (the model is velox's
``internal/arch/boundaries_test.go``). An edge is (importing app, imported app.module); imports of
the kernel (``hardcount``) need no entry, as every app stands on it. Migrations are left out: they
are generated, and name other apps only through ``dependencies``.
"""

from __future__ import annotations

import grimp

APPS = ("hardcount", "leases", "outbox", "dunning", "billing", "ops", "devstack")
KERNEL = "hardcount"

# (importing app, imported module) -> why the edge exists.
ALLOWED: dict[tuple[str, str], str] = {
    ("billing", "dunning.services"): "billing starts, continues and ends dunning runs inside its own transactions "
    "(payments, invoices, customers), runs the dunning pass (dunning_pass, collection), and asks when a test "
    "clock's next dunning retry is due (clocks)",
    ("billing", "outbox.services"): "every billing change writes its event in the same transaction",
    ("billing", "dunning.schedule"): "the admin's invoice page says when its dunning run retries next",
    ("dunning", "outbox.services"): "every dunning step writes its event in the same transaction",
    ("ops", "billing.metrics"): "the dashboard shows the same due and failing counts as /metrics",
    ("ops", "outbox.metrics"): "the dashboard shows the same delivery backlog as /metrics",
    ("ops", "leases.services"): "the dashboard shows each role's holder and last stamp",
    ("ops", "billing.shards"): "the doctor checks each sharded scheduler run against its tenants' shards, computed "
    "by billing's own shard function",
    ("ops", "billing.gateway_accounts"): "the doctor's gateway comparison reads each tenant's invoices in that "
    "tenant's own Stripe account",
    ("devstack", "billing.models"): "the demo book is seeded and its first drain watched through billing's rows",
    ("devstack", "billing.queries"): "the progress line counts due subscriptions with the drain's own due predicate",
    ("devstack", "billing.representations"): "the seeded book's events carry the same data the API shows",
    ("devstack", "outbox.services"): "the seeded book writes its events with the outbox's set-wise writer",
    ("devstack", "outbox.models"): "the progress line counts the demo book's deliveries",
    ("devstack", "outbox.signing"): "the dev webhook receiver verifies signatures with the shipped verifier",
    ("devstack", "billing.gateway_accounts"): "the dev Stripe's webhook sender posts to the platform account's "
    "inbound URL, whose slug is billing's",
}


def app_edges() -> set[tuple[str, str]]:
    """The cross-app edges of the product code as (importing app, imported ``app.module``)."""
    graph = grimp.build_graph(*APPS, cache_dir=None, exclude_type_checking_imports=False)
    edges = set()
    for importer in graph.modules:
        app = importer.split(".")[0]
        if ".migrations" in importer:
            continue
        for imported in graph.find_modules_directly_imported_by(importer):
            target = imported.split(".")[0]
            if target in (app, KERNEL):
                continue
            edges.add((app, ".".join(imported.split(".")[:2])))
    return edges


def test_every_cross_app_import_is_listed_with_its_reason():
    unlisted = sorted(app_edges() - ALLOWED.keys())
    assert not unlisted, "new cross-app imports: list each in ALLOWED with its reason, or remove it:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in unlisted
    )


def test_every_listed_cross_app_import_still_exists():
    stale = sorted(ALLOWED.keys() - app_edges())
    assert not stale, "listed imports the code no longer has: remove their entries:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in stale
    )


def test_every_listed_import_has_a_reason():
    assert all(reason.strip() for reason in ALLOWED.values())
