"""Hardcount's database backend: Django's PostgreSQL backend (with django-prometheus) plus the tenant switch."""
