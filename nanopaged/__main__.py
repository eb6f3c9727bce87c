"""`python -m nanopaged serve MODEL`: the `nanopaged` command (see `cli.py`)."""

from nanopaged.serving.cli import main

main()
