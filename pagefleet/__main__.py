"""`python -m pagefleet`: the `pagefleet` command."""

from pagefleet.cli import entry

entry()
