"""The `nanopaged` command: `nanopaged serve MODEL [options]` puts the engine behind an
OpenAI-compatible HTTP API (`server.py`). The arguments (`args.py`) are read
before anything heavy is imported, so that `--help` and a wrong flag answer at once."""

import sys

from nanopaged.serving.args import parse_args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv[1:] if argv[:1] == ["serve"] else argv)
    try:
        from nanopaged.serving.server import serve

        serve(args)
    # Ctrl-C, while the engine loads or once the server has shut down (uvicorn raises
    # the signal again): a line, as a command-line tool says it
    except KeyboardInterrupt:
        sys.exit("interrupted")


if __name__ == "__main__":
    main()
