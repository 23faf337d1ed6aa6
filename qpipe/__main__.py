"""`python -m qpipe` is the `qpipe` command."""

from qpipe.cli import main

main()
