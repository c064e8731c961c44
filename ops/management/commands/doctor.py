"""``python manage.py doctor``: the read-only money-invariant sweep (see :mod:`ops.doctor`).

Prints a table of checks (name, status, violations, a few example ids) and exits with status
0 when every check passes, 1 when any check finds a violation, 2 when a check could not run
(an error such as the statement timeout, or an unreachable gateway with ``--gateway``).
``--json`` prints the same results as one JSON document for machines.
"""

from __future__ import annotations

import json
import logging
import sys

from django.core.management.base import BaseCommand, CommandError

from ops import doctor


class Command(BaseCommand):
    help = "Check the money invariants across every tenant, read-only; exit 1 when any check fails."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="print the results as JSON")
        parser.add_argument(
            "--check",
            action="append",
            dest="checks",
            metavar="NAME",
            help="run only this check (repeatable); see --list",
        )
        parser.add_argument("--list", action="store_true", help="list the checks and their invariants, then exit")
        parser.add_argument(
            "--reaper-interval",
            type=float,
            default=60.0,
            metavar="SECONDS",
            help="how long an expired delivery claim may wait for the reaper (default 60)",
        )
        parser.add_argument(
            "--unknown-after",
            type=float,
            default=None,
            metavar="SECONDS",
            help="how long a payment outcome may stay unknown (default 5 × the gateway timeout + the billing interval)",
        )
        parser.add_argument(
            "--examples", type=int, default=5, metavar="N", help="example ids shown per failing check (default 5)"
        )
        parser.add_argument(
            "--gateway",
            action="store_true",
            help="also retrieve paid invoices' PaymentIntents through the stripe library and compare them",
        )
        parser.add_argument(
            "--gateway-limit",
            type=int,
            default=None,
            metavar="N",
            help="with --gateway, check at most N paid invoices (newest first; default all)",
        )
        parser.add_argument("--database", default="default", help="database alias (default 'default')")

    def handle(self, *args, **options):
        if options["list"]:
            for check in doctor.CHECKS:
                self.stdout.write(f"{check.name}\n    {check.invariant}\n")
            for check in doctor.OPTIONAL_CHECKS:
                self.stdout.write(f"{check.name} (with --gateway)\n    {check.invariant}\n")
            return
        known = {c.name for c in doctor.CHECKS}
        unknown = sorted(set(options["checks"] or ()) - known)
        if unknown:
            raise CommandError(f"unknown check(s): {', '.join(unknown)}; see --list")
        if options["examples"] < 0:
            raise CommandError("--examples must be 0 or more")
        results = doctor.run_checks(
            using=options["database"],
            names=options["checks"],
            reaper_interval_s=options["reaper_interval"],
            unknown_after_s=options["unknown_after"],
            max_examples=options["examples"],
        )
        if options["gateway"]:
            # One INFO line per gateway request would drown the report.
            logging.getLogger("httpx").setLevel(logging.WARNING)
            logging.getLogger("stripe").setLevel(logging.WARNING)
            results.append(
                doctor.check_gateway_refunds(
                    using=options["database"], limit=options["gateway_limit"], max_examples=options["examples"]
                )
            )
            results.append(
                doctor.check_gateway(
                    using=options["database"], limit=options["gateway_limit"], max_examples=options["examples"]
                )
            )
        if options["json"]:
            self.stdout.write(json.dumps(doctor.summary(results), indent=2, ensure_ascii=False))
        else:
            self.stdout.write(doctor.format_table(results))
        sys.exit(doctor.exit_status(results))
