"""Django format overrides for the console's pages (``FORMAT_MODULE_PATH``): times in UTC, ISO-like, labeled."""
