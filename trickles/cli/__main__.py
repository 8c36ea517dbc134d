"""``python -m trickles.cli``, as ``python -m trickles``."""

from . import entry

entry()
