"""`python -m pagefleet`: the `pagefleet` command."""

import sys

from pagefleet.cli import main

sys.exit(main())
