"""devstack: the development stack behind ``make run`` — never needed in production.

``manage.py serve`` (localstripe, the demo tenant, a webhook receiver, gunicorn), ``manage.py
seed_demo`` (the demo book), the demo's credentials and localstripe with the gateway's fixes.
Installed only when ``HARDCOUNT_DEVSTACK`` is on (the default; production turns it off, see
docs/decisions/0121-kernel-ops-and-devstack.md). The top layer with ops: no app imports it.
This package imports nothing, so ``python -m devstack.stack`` and ``python -m devstack.devstripe``
run without loading Django's settings.
"""
