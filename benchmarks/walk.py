"""The walk of one plain request: the functions of nanopaged that
`LLM(m).generate(["hi"], SamplingParams(max_tokens=8))` enters on a CPU, after one
warm-up request (comprehensions and lambdas apart), by file; docs/architecture.md quotes
it. `python -m benchmarks.walk [-v]` (-v: each function)."""

import collections
import os
import sys
import tempfile

import nanopaged
from nanopaged import LLM, SamplingParams
from nanopaged.random_checkpoint import SHAPES, write_random_checkpoint


def walk(model: str) -> dict[tuple[str, str, int], None]:
    """(file, function, first line) of each function entered, in order."""
    llm = LLM(model, max_model_len=256)
    params = SamplingParams(max_tokens=8)
    llm.generate(["hi"], params, use_tqdm=False)
    root = os.path.dirname(nanopaged.__file__) + os.sep
    entered = {}

    def note(frame, event, arg):
        code = frame.f_code
        own = code.co_filename.startswith(root) and not code.co_name.startswith("<")
        if event == "call" and own:
            where = os.path.relpath(code.co_filename, root)
            entered.setdefault((where, code.co_name, code.co_firstlineno), None)

    sys.setprofile(note)
    try:
        llm.generate(["hi"], params, use_tqdm=False)
    finally:
        sys.setprofile(None)
    return entered


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        entered = walk(write_random_checkpoint(directory, SHAPES["qwen3"]))
    by_part = collections.Counter(
        "core" if path.startswith("core") else path.split(os.sep)[0]
        for path, _, _ in entered
    )
    files = {path for path, _, _ in entered}
    print(f"{len(entered)} functions in {len(files)} files: {dict(by_part)}")
    if "-v" in sys.argv:
        for path, name, line in entered:
            print(f"{path}:{line} {name}")


if __name__ == "__main__":
    main()
