"""The operators' console (Django admin): shared building blocks, and tenants, API keys and idempotency records.

Objects change through the services (which validate, lock and emit their events), never by
editing rows here: every model admin is read-only, and what an operator may do is offered as
admin actions that call the same service functions as the API (retry billing, cancel, pay,
void, replay, revoke). Actions need the model's ``change`` permission (superusers have it), so
a staff user with view permission only can look but not act. The one kind of row created here
is credentials: a tenant (with its test and live keys) and an API key, whose secret is shown
once on the page that answers the creation and stored nowhere. No other page shows a secret or a
key's hash: API keys show their hint, idempotency records their body with secrets masked
(docs/decisions/0125), webhook endpoints no signing secret.

Lists stay fast on large tables (decision record 0110): :class:`CappedCountPaginator` counts at
most :data:`COUNT_CAP` rows, lists order by the time-ordered primary key, list filters offer
fixed choices (never a ``SELECT DISTINCT`` over the table), and actions take at most
:data:`MAX_ACTION_ROWS` rows.
"""

from __future__ import annotations

from datetime import UTC

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.core.paginator import Paginator
from django.db import transaction
from django.db.models import BooleanField, ExpressionWrapper, Model, Q, QuerySet
from django.db.models.functions import Now
from django.forms.models import BaseInlineFormSet
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html

from hardcount import audit, idempotency
from hardcount.models import ApiKey, AuditLogEntry, Claim, IdempotencyRecord, RateLimit, RateLimitBucket, Tenant
from hardcount.money import display as money_display

admin.site.site_header = "Hardcount operations"
admin.site.site_title = "Hardcount"
admin.site.index_title = "Billing operations"
# Lists are wide (ids, failure columns): the page's width goes to them; the index lists every model.
admin.site.enable_nav_sidebar = False
# The console is the site: there is no public site to "view".
admin.site.site_url = None
admin.site.empty_value_display = "—"

# Lists count matching rows up to this many; beyond it the page says "more than 10000" and
# offers the first COUNT_CAP / list_per_page pages (narrow with filters or search to go further).
COUNT_CAP = 10_000
# An action works row by row (a gateway call each, for billing); more than this is a job, not a click.
MAX_ACTION_ROWS = 100


class CappedCountPaginator(Paginator):
    """A paginator whose ``count`` reads at most ``cap + 1`` rows instead of ``COUNT(*)`` over the table.

    ``count`` is ``min(rows, cap)`` and ``capped`` tells whether more rows matched; the count
    runs without ``ORDER BY`` so the planner may use any index behind the filters. Pages past
    the cap are refused like any page out of range, which also bounds the ``OFFSET`` a page
    costs. Pass ``cap`` to change the bound (:data:`COUNT_CAP` by default).
    """

    def __init__(self, object_list, per_page, orphans=0, allow_empty_first_page=True, *, cap: int = COUNT_CAP):
        super().__init__(object_list, per_page, orphans, allow_empty_first_page)
        self.cap = cap
        self.capped = False

    @cached_property
    def count(self) -> int:
        counted = self.object_list.order_by()[: self.cap + 1].count()
        self.capped = counted > self.cap
        return min(counted, self.cap)


class AuditedAdmin(admin.ModelAdmin):
    """A model admin whose add, change and delete are also recorded in the audit log (:mod:`hardcount.audit`).

    Django's ``LogEntry`` (the object's history page) is still written; the audit entry adds the
    client's address and stays when the user is deleted. ``audit_actions`` renames an admin's
    ``add``, ``change`` or ``delete`` (``{"add": "tenant.created"}``). Admin actions record
    themselves, a row at a time, with :meth:`record_action`.
    """

    audit_actions: dict[str, str] = {}

    def _audit(self, request, kind: str, obj: Model, change: str) -> None:
        action = self.audit_actions.get(kind, f"admin.{kind}")
        audit.record(action, obj=obj, request=request, message=f"{self.opts.verbose_name} {obj}: {change}")

    def log_addition(self, request, obj, message):
        entry = super().log_addition(request, obj, message)
        self._audit(request, "add", obj, entry.get_change_message() or "Added.")
        return entry

    def log_change(self, request, obj, message):
        entry = super().log_change(request, obj, message)
        self._audit(request, "change", obj, entry.get_change_message() or "No fields changed.")
        return entry

    def log_deletions(self, request, queryset):
        rows = list(queryset)
        entries = super().log_deletions(request, rows)
        for obj in rows:
            self._audit(request, "delete", obj, "Deleted.")
        return entries

    def record_action(self, request, action: str, obj: Model, message: str, *, tenant_id: str | None = None) -> None:
        """Record that the request's user ran ``action`` (a registered name) on ``obj``, with its outcome.

        ``tenant_id`` is for rows that carry none of their own (a delivery is its event's tenant's).
        """
        audit.record(action, obj=obj, request=request, message=message, tenant_id=tenant_id)


class ReadOnlyAdmin(AuditedAdmin):
    """View-only admin: no add, change or delete; lists with capped counts and no full-table ``COUNT(*)``.

    Subclasses offer operations as admin actions declared with ``permissions=["operate"]``
    (see :meth:`has_operate_permission`) and read their rows through :meth:`selected_rows`.
    """

    list_per_page = 50
    show_full_result_count = False  # counting big tables on every page is slow
    show_facets = admin.ShowFacets.NEVER  # facet counts are a COUNT per filter choice over the table
    paginator = CappedCountPaginator
    # Time-ordered primary keys (hardcount.ids) sort newest first on the primary key's index.
    ordering = ("-pk",)
    change_form_template = "admin/hardcount/change_form.html"
    change_list_template = "admin/hardcount/change_list.html"
    # Buttons on an object's page: (action name, label) pairs of this admin's actions.
    object_actions: tuple[tuple[str, str], ...] = ()

    def has_add_permission(self, request, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request, obj: Model | None = None) -> bool:
        return False

    # Columns and fields shown in words instead: a shortened id, and the mode as "live" / "test" (Django's
    # boolean icon for livemode reads as an error on every test-mode row).
    _RENAMED = {"id": "short_pk", "livemode": "mode_word"}

    def get_list_display(self, request):
        # Ids are 30 characters and lists must fit 1440 px: the "id" column shows the id shortened.
        return tuple(self._RENAMED.get(column, column) for column in super().get_list_display(request))

    def get_fields(self, request, obj: Model | None = None):
        fields = super().get_fields(request, obj)
        if obj is None:
            return fields
        return list(dict.fromkeys("mode_word" if f == "livemode" else f for f in fields))

    def get_fieldsets(self, request, obj: Model | None = None):
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None:
            return fieldsets
        return [
            (name, {**options, "fields": [("mode_word" if f == "livemode" else f) for f in options["fields"]]})
            for name, options in fieldsets
        ]

    @admin.display(description="mode")
    def mode_word(self, obj: Model) -> str:
        return "live" if obj.livemode else "test"

    def get_sortable_by(self, request):
        return tuple("short_pk" if column == "id" else column for column in super().get_sortable_by(request))

    @admin.display(description="id", ordering="pk")
    def short_pk(self, obj: Model):
        return short_id(obj.pk)

    def get_readonly_fields(self, request, obj: Model | None = None):
        # A view page shows the fields a form cannot edit too (ids, creation times, sequences).
        declared = list(super().get_readonly_fields(request, obj))
        if obj is None:
            return declared
        hidden = {*(self.exclude or ()), *declared}
        own = [f.name for f in self.opts.concrete_fields if not f.editable and f.name not in hidden] + declared
        return own + (["mode_word"] if any(f.name == "livemode" for f in self.opts.concrete_fields) else [])

    def has_operate_permission(self, request) -> bool:
        """May the user run this admin's actions? Those who hold the model's ``change`` permission may.

        The change form itself stays read-only for everyone: the permission gates operations
        through the services, not edits of rows.
        """
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):  # noqa: PLR0917 - Django's signature
        if obj is not None:
            context["can_operate"] = self.has_operate_permission(request)
            context["object_actions"] = [
                (action, label) for action, label in self.object_actions if self.object_action_applies(obj, action)
            ]
            context["object_links"] = self.object_links(obj)
            context["subtitle"] = context["object_label"] = self.object_label(obj)
        return super().render_change_form(request, context, add, change, form_url, obj)

    def object_label(self, obj: Model) -> str:
        """What the row is, in words, for its page's heading and breadcrumbs and confirmation lists
        (``Invoice INV-0042 · $15.00 · open``); the model's ``str`` unless an admin says better."""
        return str(obj)

    def object_links(self, obj: Model) -> list[tuple[str, str]]:
        """``(url, label)`` links shown beside the action buttons of ``obj``'s page (its dunning run …)."""
        return []

    def object_action_applies(self, obj: Model, action: str) -> bool:
        """Whether ``obj``'s page offers the button of ``action`` (the service still decides; this hides
        buttons that could only be refused)."""
        return True

    def selected_rows(self, request, queryset: QuerySet) -> list[Model] | None:
        """The action's rows (oldest first), or None after telling the user the selection is too large."""
        rows = list(queryset.order_by("pk")[: MAX_ACTION_ROWS + 1])
        if len(rows) > MAX_ACTION_ROWS:
            self.message_user(
                request,
                f"Select at most {MAX_ACTION_ROWS} {self.opts.verbose_name_plural} per action; nothing was done.",
                messages.ERROR,
            )
            return None
        return rows

    def confirm_action(self, request, rows: list[Model], *, action: str, question: str, consequence: str, form=None):
        """A confirmation page for a destructive action, or None once the user has confirmed it.

        The page posts the same action and rows back with ``confirmed=yes`` (CSRF-protected like
        every admin form). An action that takes input passes its ``form``, bound to the POST once
        confirmed (:func:`action_form`): the page shows its fields, and shows them again with their
        errors until they are valid; None only then.
        """
        if request.POST.get("confirmed") == "yes" and (form is None or form.is_valid()):
            return None
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": question,
            "rows": rows,
            "labels": [(row, self.object_label(row)) for row in rows],
            "action": action,
            "consequence": consequence,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "return_to": request.POST.get("_return_to", ""),
            "form": form,
        }
        return TemplateResponse(request, "admin/hardcount/confirm_action.html", context)

    def after_action(self, request, rows: list[Model]):
        """Where an action answers: the object's page when it was started there, else the list (None)."""
        if request.POST.get("_return_to") == "change" and len(rows) == 1:
            opts = self.opts
            return HttpResponseRedirect(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[rows[0].pk]))
        return None


def action_form(request, form_class: type[forms.Form], **kwargs) -> forms.Form:
    """``form_class`` bound to the POST when it confirms an action (``confirmed=yes``), else unbound (the first
    page shows the fields empty, not as errors); ``kwargs`` go to the form."""
    data = request.POST if request.POST.get("confirmed") == "yes" else None
    return form_class(data, **kwargs)


class RecentRowsFormSet(BaseInlineFormSet):
    """Inline rows limited to the first ``limit`` of the inline's ordering (newest first, usually)."""

    limit = 50

    def get_queryset(self):
        if not hasattr(self, "_recent_rows"):
            self._recent_rows = super().get_queryset()[: self.limit]
        return self._recent_rows


class ReadOnlyInline(admin.TabularInline):
    """View-only inline rows: the newest :attr:`RecentRowsFormSet.limit` of them.

    Rows are compact (the ``hc-rows`` class hides Django's per-row caption); put ``row_link``
    first in ``fields`` (and in ``readonly_fields``) for a link to the row's own page.
    """

    extra = 0
    can_delete = False
    show_change_link = False
    classes = ("hc-rows",)
    formset = RecentRowsFormSet
    ordering = ("-pk",)

    def get_readonly_fields(self, request, obj: Model | None = None):
        return (
            *super().get_readonly_fields(request, obj),
            *(f for f in self.fields or () if f not in self.readonly_fields),
        )

    @admin.display(description="id")
    def row_link(self, obj: Model) -> str:
        return id_link(type(obj), obj.pk)

    def has_add_permission(self, request, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request, obj: Model | None = None) -> bool:
        return False


def mode_filter(path: str = "livemode") -> type[admin.SimpleListFilter]:
    """A list filter ``?mode=live|test`` on the boolean at ``path`` (no query to build its choices)."""

    class ModeFilter(admin.SimpleListFilter):
        title = "mode"
        parameter_name = "mode"

        def lookups(self, request, model_admin):
            return (("live", "live"), ("test", "test"))

        def queryset(self, request, queryset):
            if self.value() in ("live", "test"):
                return queryset.filter(**{path: self.value() == "live"})
            return queryset

    return ModeFilter


def choices_filter(
    path: str, choices, *, title: str, parameter_name: str | None = None
) -> type[admin.SimpleListFilter]:
    """A list filter offering fixed ``choices`` (values, or ``(value, label)`` pairs) for ``path`` = value.

    Django's default filter for a field without choices reads ``SELECT DISTINCT`` over the whole
    table on every page load; this one builds its choices without a query.
    """
    pairs = tuple(c if isinstance(c, tuple) else (c, c) for c in choices)

    class ChoicesFilter(admin.SimpleListFilter):
        def lookups(self, request, model_admin):
            return pairs

        def queryset(self, request, queryset):
            if self.value() is not None:
                return queryset.filter(**{path: self.value()})
            return queryset

    ChoicesFilter.title = title
    ChoicesFilter.parameter_name = parameter_name or path
    return ChoicesFilter


def id_link(model: type[Model], pk: str | None, text: str | None = None) -> str:
    """HTML link to the admin page of ``model`` row ``pk`` without loading it (``—`` for None)."""
    if pk is None:
        return "—"
    opts = model._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk])
    return format_html('<a href="{}">{}</a>', url, text or pk)


def console_locale() -> str:
    """The locale amounts are written in (``HARDCOUNT_CONSOLE_LOCALE``, a Babel locale name; ``en_US`` by default)."""
    return getattr(settings, "HARDCOUNT_CONSOLE_LOCALE", "en_US")


def money(amount: int | None, currency: str) -> str:
    """An amount in integer minor units as the console writes it: ``$15.00``, ``€12.99``, ``¥1,000``, ``KWD1.500``.

    ``currency`` is an ISO 4217 code (any case). The number of minor digits is the currency's
    exponent from Babel's ISO 4217 data (``tests/admin/test_money_display.py`` checks it equals
    :data:`hardcount.money.CURRENCY_EXPONENTS`, which the amounts are stored in); symbol, grouping
    and order are the console locale's (:func:`console_locale`). ``—`` for None; a code Babel does
    not know is shown as ``1500 (minor units, XYZ)`` rather than guessed.
    """
    if amount is None:
        return "—"
    return money_display(amount, currency, locale=console_locale())


def price_label(amount: int, currency: str, interval: str, interval_count: int = 1) -> str:
    """A recurring price as every page writes it: ``€12.99 / week``, ``$90.00 / 3 months``."""
    every = interval if interval_count == 1 else f"{interval_count} {interval}s"
    return f"{money(amount, currency)} / {every}"


def short_time(value) -> str:
    """A timestamp as every page writes it: ``2026-12-15 23:30 UTC`` (times are UTC everywhere); ``—`` for None."""
    return "—" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def clock_time(value, *, on_clock: bool) -> str:
    """:func:`short_time`, labeled ``(test clock)`` for an object on a test clock, whose times are the clock's."""
    text = short_time(value)
    return f"{text} (test clock)" if on_clock and value is not None else text


def short_id(pk: str) -> str:
    """A list's id: ``sub_…bgmf59na`` (the prefix and the last 8 characters, random in time-ordered ids:
    distinct within a list), the whole id in the tooltip. Ids without a prefix are shown whole."""
    prefix, sep, rest = str(pk).partition("_")
    if not sep or len(rest) <= 12:
        return str(pk)
    return format_html('<span title="{}">{}_…{}</span>', pk, prefix, rest[-8:])


def truncated(text: str, length: int = 40) -> str:
    """``text`` cut to ``length`` characters with ``…``, the whole of it in the tooltip (long URLs, errors)."""
    if not text or len(text) <= length:
        return text or ""
    return format_html('<span title="{}">{}…</span>', text, text[: length - 1])


def prefixed_search(queryset: QuerySet, search_term: str, routes: dict[str, str], default: str | None = None):
    """Search by exact value, routed by the id prefix: ``routes`` maps ``"sub_"`` to the field it names.

    Each whitespace-separated term must match (as in Django's search): a term with a known
    prefix filters the routed field, any other term the ``default`` field (no match when None).
    Every lookup is an equality an index answers, never ``LIKE '%…%'`` over the table.
    Returns ``(queryset, may_have_duplicates)`` like :meth:`ModelAdmin.get_search_results`.
    """
    for term in search_term.split():
        path = next((field for prefix, field in routes.items() if term.startswith(prefix)), default)
        queryset = queryset.filter(**{path: term}) if path else queryset.none()
    return queryset, False


# --- credentials: tenants and API keys ------------------------------------------------------------------------------


def _secrets_page(request, model_admin, *, title: str, tenant: Tenant, keys: list[tuple[ApiKey, str]]):
    """The only page that ever shows a key's secret: rendered in the creating POST's response, never cached."""
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.opts,
        "title": title,
        "tenant": tenant,
        "keys": keys,
    }
    response = TemplateResponse(request, "admin/hardcount/secret_once.html", context)
    response["Cache-Control"] = "no-store"
    return response


class TenantCreateForm(forms.ModelForm):
    class Meta:
        model = Tenant
        fields = ["name"]

    def clean_name(self) -> str:
        name = self.cleaned_data["name"].strip()
        if not name:
            raise forms.ValidationError("A tenant needs a name.")
        return name


class ApiKeyInline(ReadOnlyInline):
    model = ApiKey
    fields = ("row_link", "key_hint", "livemode", "created_at", "revoked_at")
    readonly_fields = fields


class RateLimitInline(ReadOnlyInline):
    model = RateLimit
    fields = ("bucket", "per_s", "burst", "updated_at")
    verbose_name_plural = "rate limits of its own (manage.py ratelimit)"


@admin.register(Tenant)
class TenantAdmin(ReadOnlyAdmin):
    """Tenants; adding one issues its test and live keys (shown once), like ``manage.py createtenant``."""

    list_display = ("id", "name", "created_at")
    search_fields = ("id__exact", "name")
    form = TenantCreateForm
    inlines = [ApiKeyInline, RateLimitInline]
    audit_actions = {"add": audit.TENANT_CREATED}

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else ("id", "created_at")

    def get_inlines(self, request, obj):
        return [] if obj is None else self.inlines

    def has_add_permission(self, request, obj: Model | None = None) -> bool:
        return admin.ModelAdmin.has_add_permission(self, request)

    def save_model(self, request, obj: Tenant, form, change: bool) -> None:
        with transaction.atomic():
            obj.save()
            obj.issued_keys = [ApiKey.issue(obj, livemode=False), ApiKey.issue(obj, livemode=True)]
            for key, _secret in obj.issued_keys:
                self.record_action(request, audit.API_KEY_ISSUED, key, f"Issued {key} with tenant {obj.name}.")

    def response_add(self, request, obj: Tenant, post_url_continue=None):
        return _secrets_page(request, self, title=f"Tenant {obj.name} created", tenant=obj, keys=obj.issued_keys)


class ApiKeyCreateForm(forms.ModelForm):
    mode = forms.ChoiceField(choices=(("test", "test (hc_test_…)"), ("live", "live (hc_live_…)")))

    class Meta:
        model = ApiKey
        fields = ["tenant"]


@admin.register(ApiKey)
class ApiKeyAdmin(ReadOnlyAdmin):
    """API keys: create one (its secret is shown once, only its hash is kept) or revoke some."""

    list_display = ("id", "key_hint", "tenant", "livemode", "created_at", "revoked_at")
    list_filter = (mode_filter(), ("revoked_at", admin.EmptyFieldListFilter), "tenant")
    list_select_related = ("tenant",)
    search_fields = ("id__exact", "key_hint__startswith", "tenant__id__exact")
    exclude = ("key_hash",)
    actions = ["revoke"]
    object_actions = (("revoke", "Revoke"),)
    audit_actions = {"add": audit.API_KEY_ISSUED}

    def has_add_permission(self, request, obj: Model | None = None) -> bool:
        return admin.ModelAdmin.has_add_permission(self, request)

    def object_action_applies(self, obj: ApiKey, action: str) -> bool:
        return obj.revoked_at is None

    def get_form(self, request, obj=None, change=False, **kwargs):
        if obj is None:
            kwargs["form"] = ApiKeyCreateForm
            kwargs["fields"] = ["tenant", "mode"]
        return super().get_form(request, obj, change, **kwargs)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["tenant", "mode"]
        return super().get_fields(request, obj)

    def save_model(self, request, obj: ApiKey, form, change: bool) -> None:
        row, secret = ApiKey.issue(form.cleaned_data["tenant"], livemode=form.cleaned_data["mode"] == "live")
        for field in ApiKey._meta.concrete_fields:
            setattr(obj, field.attname, getattr(row, field.attname))
        obj._state.adding = False
        obj.issued_secret = secret

    def response_add(self, request, obj: ApiKey, post_url_continue=None):
        return _secrets_page(request, self, title="API key created", tenant=obj.tenant, keys=[(obj, obj.issued_secret)])

    @admin.action(description="Revoke selected keys (requests with them get 401 at once)", permissions=["operate"])
    def revoke(self, request, queryset):
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        with transaction.atomic():
            revoked = list(
                ApiKey.objects.select_for_update()
                .filter(pk__in=[key.pk for key in rows], revoked_at__isnull=True)
                .order_by("pk")
            )
            ApiKey.objects.filter(pk__in=[key.pk for key in revoked]).update(revoked_at=timezone.now())
            for key in revoked:
                self.record_action(request, audit.API_KEY_REVOKED, key, f"Revoked {key}.")
        self.message_user(request, f"Revoked {len(revoked)} key(s).")
        return self.after_action(request, rows)


class ResponseClassFilter(admin.SimpleListFilter):
    """Idempotency records by the class of their stored response (or still in flight)."""

    title = "response"
    parameter_name = "response"
    CLASSES = {
        "2xx": Q(response_status__gte=200, response_status__lt=300),
        "4xx": Q(response_status__gte=400, response_status__lt=500),
        "5xx": Q(response_status__gte=500),
        "in_flight": Q(completed_at__isnull=True),
    }

    def lookups(self, request, model_admin):
        return (("2xx", "2xx"), ("4xx", "4xx"), ("5xx", "5xx"), ("in_flight", "in flight"))

    def queryset(self, request, queryset):
        predicate = self.CLASSES.get(self.value())
        return queryset if predicate is None else queryset.filter(predicate)


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyAdmin):
    """Idempotency records; the stored response is shown with every secret-named field masked."""

    list_display = ("key", "tenant", "livemode", "response_status", "created_at", "completed_at")
    list_filter = (mode_filter(), ResponseClassFilter)
    list_select_related = ("tenant",)
    search_fields = ("key__exact", "tenant__id__exact")
    # The raw body never reaches a page: records stored before decision 0125 held secrets in clear.
    exclude = ("response_body",)
    readonly_fields = ("stored_response",)

    @admin.display(description="response body")
    def stored_response(self, record: IdempotencyRecord) -> str:
        return format_html('<pre class="hc-json">{}</pre>', idempotency.display_body(record.response_body))


# --- rate limits (hardcount.ratelimit, docs/decisions/0128-api-rate-limits.md) ---------------------------------------


@admin.register(RateLimit)
class RateLimitAdmin(ReadOnlyAdmin):
    """Tenants' own limits, replacing the defaults for their keys; set with ``manage.py ratelimit``."""

    list_display = ("tenant", "bucket", "per_s", "burst", "updated_at")
    list_select_related = ("tenant",)
    search_fields = ("tenant__id__exact",)
    ordering = ("tenant_id", "bucket")


@admin.register(RateLimitBucket)
class RateLimitBucketAdmin(ReadOnlyAdmin):
    """Each key's buckets as its last request left them; ``allowed`` off means that request was refused (429)."""

    list_display = ("api_key", "bucket", "tokens_display", "allowed", "per_s", "burst", "updated_at")
    list_filter = ("allowed", choices_filter("bucket", tuple(settings.HARDCOUNT_RATE_LIMITS), title="bucket"))
    list_select_related = ("api_key",)
    search_fields = ("api_key__id__exact",)
    ordering = ("-updated_at",)

    @admin.display(description="tokens left")
    def tokens_display(self, bucket: RateLimitBucket) -> str:
        return f"{bucket.tokens:.2f}"


# --- claims (hardcount.claims, docs/decisions/0182-claims-instead-of-session-locks.md) -------------------------------


@admin.register(Claim)
class ClaimAdmin(ReadOnlyAdmin):
    """Who holds a test clock's walk or a clock invoice's charge now, until when (the database's clock)."""

    list_display = ("key", "holder", "taken_at", "expires_at", "live")
    search_fields = ("key__startswith", "holder__startswith")
    ordering = ("key",)

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .annotate(live_d=ExpressionWrapper(Q(expires_at__gt=Now()), output_field=BooleanField()))
        )

    @admin.display(description="live", boolean=True)
    def live(self, claim: Claim) -> bool:
        return bool(claim.live_d)


# --- the audit log (hardcount.audit) ---------------------------------------------------------------------------------


class ActorFilter(admin.SimpleListFilter):
    """Entries by actor: one staff user, or every command-line or API-key entry (no query over the log)."""

    title = "actor"
    parameter_name = "actor"
    MAX_USERS = 100

    def lookups(self, request, model_admin):
        users = User.objects.filter(is_staff=True).order_by("username").values_list("pk", "username")
        return (
            *((f"user:{pk}", username) for pk, username in users[: self.MAX_USERS]),
            (AuditLogEntry.CLI, "any command (cli)"),
            (AuditLogEntry.API_KEY, "any API key"),
        )

    def queryset(self, request, queryset):
        value = self.value()
        if value is None:
            return queryset
        kind, _, actor_id = value.partition(":")
        if actor_id:
            return queryset.filter(actor_type=kind, actor_id=actor_id)
        return queryset.filter(actor_type=kind)


class ActionFilter(admin.SimpleListFilter):
    """Entries by action, offering every registered action name (:func:`hardcount.audit.actions`)."""

    title = "action"
    parameter_name = "action"

    def lookups(self, request, model_admin):
        return tuple((name, name) for name in sorted(audit.registered_actions()))

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(action=self.value())


class ObjectTypeFilter(admin.SimpleListFilter):
    """Entries by the type of object acted on: every installed model (``app_label.model_name``)."""

    title = "object type"
    parameter_name = "object_type"

    def lookups(self, request, model_admin):
        from django.apps import apps

        return tuple(sorted((m._meta.label_lower, m._meta.label_lower) for m in apps.get_models()))

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(object_type=self.value())


@admin.register(AuditLogEntry)
class AuditLogEntryAdmin(ReadOnlyAdmin):
    """The audit log, newest first: no one adds, changes or deletes an entry (the database refuses it too)."""

    list_display = ("created_at", "actor", "action", "object_type", "object_id", "tenant_id", "remote_addr", "message")
    list_filter = (ActorFilter, ActionFilter, ObjectTypeFilter, ("created_at", admin.DateFieldListFilter))
    search_fields = ("actor_id", "actor_label", "object_id", "tenant_id", "remote_addr")
    search_help_text = "Exact actor (user id, username, key id or hint), object id, tenant id or address."

    def get_search_results(self, request, queryset, search_term):
        for term in search_term.split():
            queryset = queryset.filter(
                Q(actor_id=term) | Q(actor_label=term) | Q(object_id=term) | Q(tenant_id=term) | Q(remote_addr=term)
            )
        return queryset, False

    @admin.display(description="actor")
    def actor(self, entry: AuditLogEntry) -> str:
        label = entry.actor_label if entry.actor_label and entry.actor_label != entry.actor_id else ""
        return f"{entry.get_actor_type_display()} {entry.actor_id}" + (f" ({label})" if label else "")


# Staff users and groups: Django's own admins, with their changes (passwords, permissions) in the audit log.
admin.site.unregister(User)
admin.site.unregister(Group)


@admin.register(User)
class AuditedUserAdmin(AuditedAdmin, UserAdmin):
    pass


@admin.register(Group)
class AuditedGroupAdmin(AuditedAdmin, GroupAdmin):
    pass
