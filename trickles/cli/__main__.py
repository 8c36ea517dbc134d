"""``python -m trickles.cli``, as ``python -m trickles``."""

import sys

from . import main

sys.exit(main())
