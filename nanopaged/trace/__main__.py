"""`python -m nanopaged.trace run.jsonl -o run.html`: writes the page that plays a
trace back."""

from nanopaged.trace import main

main()
