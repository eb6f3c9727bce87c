"""The `nanopaged` command: `nanopaged serve MODEL [options]` puts the engine behind an
OpenAI-compatible HTTP API (`server.py`). The arguments (`args.py`) are read
before anything heavy is imported, so that `--help` and a wrong flag answer at once."""

import sys

from nanopaged.serving.args import parse_args

HELP = """usage: nanopaged serve MODEL [options]

nanopaged, a small LLM inference engine with paged attention.

commands:
  serve    serve MODEL (a checkpoint directory or a Hugging Face id) behind an
           OpenAI-compatible HTTP API; `nanopaged serve --help` lists its options

Offline, serve a local directory: `python -m nanopaged.random_checkpoint DIR` writes a
small random-weight one to try it on."""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in ([], ["-h"], ["--help"]):
        print(HELP)
        return
    if argv[0] != "serve":
        sys.exit(
            f"nanopaged: error: unknown command {argv[0]!r}; the command is "
            f"`nanopaged serve MODEL [options]` (nanopaged --help)"
        )
    args = parse_args(argv[1:])
    try:
        from nanopaged.serving.server import serve

        serve(args)
    # Ctrl-C, while the engine loads or once the server has shut down (uvicorn raises
    # the signal again): a line, as a command-line tool says it
    except KeyboardInterrupt:
        sys.exit("interrupted")


if __name__ == "__main__":
    main()
