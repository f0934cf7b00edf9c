"""``python -m medusa_core.train``: the command line in ``cli.py``."""

from .cli import main

if __name__ == "__main__":
    main()
