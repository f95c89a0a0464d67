"""``python -m tokenbudget``: the console script."""

import sys

from tokenbudget.engine.cli.main import main

sys.exit(main())
