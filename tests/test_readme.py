"""Every code block of the README and of each page of docs/ runs, or is checked, as
written.

Python blocks run in order, one session a page: the offline ones, then those that talk
to a server against the server the README starts (with a random-weight checkpoint for
the model ids and a free port for 8000). A shell block's every command is one this test
knows how to check: `pip install` (what CI does), `nanopaged serve` and the server's
module paths (parsed as the server parses them, the README's started), `curl` (run
against that server), `python bench.py` and `python example.py` (parsed by
tests/test_bench.py, and run by tests/test_example.py).
```text blocks are diagrams and templates."""

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from nanopaged.parallel.tensor import free_port
from nanopaged.serving.args import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
    f"docs/{name}"
    for name in os.listdir(os.path.join(ROOT, "docs"))
    if name.endswith(".md")
)
MODEL_IDS = re.compile(r"Qwen/Qwen3-[0-9.]+B")
VISION_IDS = re.compile(r"Qwen/Qwen2\.5-VL-[0-9]+B-Instruct")
SERVER_COMMANDS = (
    "nanopaged serve",
    "python -m nanopaged.serving.server",
    "python -m nanopaged.entrypoints.openai.api_server",
)


def blocks(page: str, language: str) -> list[str]:
    with open(os.path.join(ROOT, page)) as f:
        return [
            code
            for lang, code in re.findall(r"```(\w*)\n(.*?)```", f.read(), re.S)
            if lang == language
        ]


def commands(page: str) -> list[str]:
    """The commands of a page's shell blocks, continued lines joined, comments
    dropped."""
    found = []
    for code in blocks(page, "bash"):
        for line in code.replace("\\\n", " ").splitlines():
            line = (
                " ".join(line.split("#")[0].split())
                if not line.startswith("curl")
                else line
            )
            if line.strip():
                found.append(line.strip())
    return found


def talks_to_a_server(code: str) -> bool:
    return "OpenAI(" in code or "client." in code


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_python_shell_or_text_and_every_command_is_checked(page):
    with open(os.path.join(ROOT, page)) as f:
        languages = {
            lang for lang, _ in re.findall(r"```(\w*)\n(.*?)```", f.read(), re.S)
        }
    assert languages <= {"python", "bash", "text"}
    for command in commands(page):
        if command.startswith(SERVER_COMMANDS):
            arguments = shlex.split(command)
            arguments = arguments[2:] if arguments[0] == "nanopaged" else arguments[3:]
            args = parse_args(arguments)
            assert args.model.startswith("Qwen/") and args.port == 8000, command
        else:
            assert command.startswith(
                ("pip install", "curl ", "python bench.py", "python example.py")
            ), command


def run(code: str, namespace: dict, model: str, port: int, vision: str = "") -> str:
    """Runs a block with the model ids (a vision-language model's: `vision`) and the
    port replaced; returns what it printed."""
    code = VISION_IDS.sub(vision, MODEL_IDS.sub(model, code))
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), namespace)
    return printed.getvalue()


@pytest.mark.parametrize(
    "page",
    [
        p
        for p in PAGES
        if any(not talks_to_a_server(code) for code in blocks(p, "python"))
    ],
)
def test_the_offline_blocks_run_as_written(page, qwen3_path, tmp_path):
    from nanopaged.random_checkpoint import write_random_vision_checkpoint

    namespace: dict = {}
    vision = ""
    for code in blocks(page, "python"):
        if VISION_IDS.search(code) and not vision:
            vision = write_random_vision_checkpoint(str(tmp_path / "vision"))
        if not talks_to_a_server(code):
            # each shows its result
            assert run(code, namespace, qwen3_path, 0, vision).strip(), code


@pytest.fixture(scope="module")
def readme_server(qwen3_path):
    """The README's `nanopaged serve MODEL ...`, as written but for the checkpoint and
    the port (its `pip install` is the set-up CI has done); the random model writes
    compact JSON, so that its objects end. -> (the name clients use, the port)"""
    [command] = [c for c in commands("README.md") if c.startswith("nanopaged serve")]
    arguments = shlex.split(command)
    served_as, port = arguments[2], free_port()
    arguments[2], arguments[arguments.index("--port") + 1] = qwen3_path, str(port)
    executable = (
        [shutil.which("nanopaged")]
        if shutil.which("nanopaged")
        else [sys.executable, "-m", "nanopaged.serving.cli"]
    )
    server = subprocess.Popen(
        [
            *executable,
            *arguments[1:],
            "--served-model-name",
            served_as,
            "--max-model-len",
            "512",
            "--structured-outputs-config",
            '{"disable_any_whitespace": true}',
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until_healthy(server, port)
        yield served_as, port
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_the_server_blocks_run_as_written(readme_server):
    served_as, port = readme_server
    for page in PAGES:
        for command in commands(page):
            if command.startswith("curl") and shutil.which("curl"):
                answer = subprocess.run(
                    ["bash", "-c", command.replace("8000", str(port))],
                    capture_output=True,
                    text=True,
                    timeout=60,
                ).stdout
                assert json.loads(answer)["choices"][0]["finish_reason"] in (
                    "stop",
                    "length",
                )
        namespace: dict = {}
        for code in blocks(page, "python"):
            if talks_to_a_server(code):
                assert run(code, namespace, served_as, port).strip(), code
        if "trip" in namespace:
            assert (
                1 <= namespace["trip"].days <= 30 and len(namespace["trip"].city) <= 20
            )


def wait_until_healthy(server: subprocess.Popen, port: int) -> None:
    for _ in range(600):
        assert server.poll() is None, server.stderr.read()[-3000:]
        try:
            if (
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code
                == 200
            ):
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("the server did not start")


@pytest.mark.parametrize("page", PAGES)
def test_every_link_of_a_page_leads_to_a_file(page):
    with open(os.path.join(ROOT, page)) as f:
        links = re.findall(r"\]\(([^)#]+)\)", f.read())
    for link in links:
        if not link.startswith("http"):
            assert os.path.exists(os.path.join(ROOT, os.path.dirname(page), link)), link


def set_up_lines() -> list[str]:
    """The commands of the README's set-up block (indented under "## Set up")."""
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("## Set up\n\n", 1)[1].split("\n\n")[0]
    return [line.split("#")[0].strip() for line in section.splitlines()]


def test_the_set_up_blocks_install_serves_scripts_run_beside_the_clone(tmp_path):
    """The set-up block's install of nanopaged (without its dependencies, into a new
    venv): a script run from the folder that holds a clone named `nanopaged` imports
    the package, not the clone's folder (an empty namespace package)."""
    [install] = [line for line in set_up_lines() if line.startswith("pip install -e .")]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    arguments = shlex.split(install)[1:]
    subprocess.run(
        [python, "-m", "pip", *arguments, "-q", "--no-deps"], cwd=ROOT, check=True
    )
    os.symlink(ROOT, tmp_path / "nanopaged")  # the clone, as `git clone` names it
    said = subprocess.run(  # the package's own file, not an empty namespace's None
        [python, "-c", "import nanopaged; print(nanopaged.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert said.stdout.strip() == os.path.join(ROOT, "nanopaged", "__init__.py")
