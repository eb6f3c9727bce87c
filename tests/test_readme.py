"""Every Python and shell block of the README runs as written: the Python blocks in order, as
one session (the offline ones, then the server ones against the server the README starts), with
a random-weight checkpoint for the Hugging Face model ids and a free port for 8000. ```text
blocks are diagrams and templates."""
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

from nanopaged.parallel import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_IDS = re.compile(r"Qwen/Qwen3-[0-9.]+B")


def blocks(language: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return [code for lang, code in re.findall(r"```(\w*)\n(.*?)```", f.read(), re.S)
                if lang == language]


def test_the_readme_has_only_python_bash_and_text_blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        assert set(re.findall(r"```(\w*)\n", f.read())) <= {"python", "bash", "text", ""}
    assert len(blocks("python")) >= 5 and len(blocks("bash")) >= 2


def run(code: str, namespace: dict, model: str, port: int) -> str:
    """Runs a block with the model ids and the port replaced; returns what it printed."""
    code = MODEL_IDS.sub(model, code).replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), namespace)
    return printed.getvalue()


def test_the_readme_runs_as_written(qwen3_path):
    python, shell = blocks("python"), blocks("bash")
    offline = [code for code in python if "OpenAI(" not in code and "client." not in code]
    namespace: dict = {}
    for code in offline:
        assert run(code, namespace, qwen3_path, 0).strip(), code
    # the server block's `nanopaged serve MODEL ...`, as written (its `pip install` is the set-up
    # CI has done); the name clients use for the model is the README's, and the random model
    # writes compact JSON, so that its objects end
    [serve] = [code for code in shell if "nanopaged serve" in code]
    command = next(line for line in serve.splitlines() if line.startswith("nanopaged serve"))
    arguments = shlex.split(command.split("#")[0])
    served_as, port = arguments[2], free_port()
    arguments[2], arguments[arguments.index("--port") + 1] = qwen3_path, str(port)
    executable = [shutil.which("nanopaged")] if shutil.which("nanopaged") else [
        sys.executable, "-m", "nanopaged.cli"]
    server = subprocess.Popen(
        [*executable, *arguments[1:], "--served-model-name", served_as, "--max-model-len", "512",
         "--structured-outputs-config", '{"disable_any_whitespace": true}'],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(server, port)
        [curl] = [code for code in shell if code.startswith("curl")]
        if shutil.which("curl"):
            answer = subprocess.run(["bash", "-c", curl.replace("8000", str(port))],
                                    capture_output=True, text=True, timeout=60).stdout
            assert json.loads(answer)["choices"][0]["finish_reason"] in ("stop", "length")
        for code in python:
            if code not in offline:
                run(code, namespace, served_as, port)
        assert 1 <= namespace["trip"].days <= 30
    finally:
        server.terminate()
        server.wait(timeout=60)


def wait_until_healthy(server: subprocess.Popen, port: int) -> None:
    for _ in range(600):
        assert server.poll() is None, server.stderr.read()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("the server did not start")
