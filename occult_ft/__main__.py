"""`python -m occult_ft` is the `occult-ft` console script."""

import sys

from .cli import main

sys.exit(main())
