"""``python -m tokenbudget``: the console script."""

import sys

from tokenbudget.cli.main import main

sys.exit(main())
