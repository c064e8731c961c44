"""English formats of the console: ``2026-12-01 14:03 UTC`` for every date-time a page shows (docs/decisions/0136)."""

DATETIME_FORMAT = "Y-m-d H:i T"
SHORT_DATETIME_FORMAT = "Y-m-d H:i T"
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = "Y-m-d"
TIME_FORMAT = "H:i T"
