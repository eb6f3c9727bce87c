"""`python -m nanopaged serve MODEL`: the `nanopaged` command (see `cli.py`)."""

from nanopaged.cli import main

main()
