"""The `nanopaged` command: `nanopaged serve MODEL [options]` puts the engine behind an
OpenAI-compatible HTTP API (`server.py`). The arguments (`args.py`) are read
before anything heavy is imported, so that `--help` and a wrong flag answer at once."""

import sys

from nanopaged.serving.args import parse_args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv[1:] if argv[:1] == ["serve"] else argv)
    from nanopaged.serving.server import serve

    serve(args)


if __name__ == "__main__":
    main()
