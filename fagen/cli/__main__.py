"""`python -m fagen.cli ...`: the same as the `fagen` command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
