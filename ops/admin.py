"""The admin index shows the operators' dashboard (:mod:`ops.dashboard`) above the list of models.

Imported by the admin's autodiscovery like every app's ``admin`` module. The template extends
Django's own ``admin/index.html``, so the rest of the index is the admin's.
"""

from django.contrib import admin

admin.site.index_template = "ops/admin_index.html"
