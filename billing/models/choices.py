"""The base of billing's closed vocabularies (the words a status or outcome column may hold)."""

from django.db import models


class WordChoices(models.TextChoices):
    """``TextChoices`` whose label is the stored word itself.

    A field's ``choices`` stay ``[(word, word), …]``, as they were written before the
    vocabularies became enums, so making one an enum changes no migration and no admin label.
    Members are ``str``: they compare, hash, serialise to JSON and bind as SQL parameters as
    their word does.
    """

    @property
    def label(self) -> str:
        """The stored word (Django's default would be the member's name, title-cased)."""
        return self.value
