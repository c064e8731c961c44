"""Dunning's /v1 URL patterns (included by :mod:`hardcount.urls` under ``v1/``)."""

from django.urls import path

from dunning import api

urlpatterns = [
    path("dunning_settings", api.DunningSettingsView.as_view(), name="dunning-settings"),
    path("dunning_runs", api.DunningRunListView.as_view(), name="dunning-runs"),
    path("dunning_runs/<str:id>", api.DunningRunDetailView.as_view(), name="dunning-run"),
]
