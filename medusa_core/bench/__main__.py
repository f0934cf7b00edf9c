"""``python -m medusa_core.bench``: the command line in ``cli.py``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
