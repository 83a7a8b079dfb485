"""`python -m runplane.cli` — the `runplane` command."""

import sys

from .main import main

sys.exit(main())
