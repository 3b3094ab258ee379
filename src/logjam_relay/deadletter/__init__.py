"""The dead-letter store: events an output could not deliver (see ``store.py``)."""

from .store import DeadLetter, DeadLetterStore, read_dead_letters

__all__ = ["DeadLetter", "DeadLetterStore", "read_dead_letters"]
