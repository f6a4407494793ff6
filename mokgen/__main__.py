"""``python -m mokgen``: the mokgen command line."""

import sys

from mokgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
