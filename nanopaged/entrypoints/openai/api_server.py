"""`python -m nanopaged.entrypoints.openai.api_server --model MODEL [options]`: the
server, at vLLM's module path (the same as `nanopaged serve MODEL`)."""

from nanopaged.serving.server import main

if __name__ == "__main__":
    main()
