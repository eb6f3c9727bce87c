"""`python example.py` runs on a machine with no model and no network, and never passes
random weights off as a model the user named."""

import os
import signal
import subprocess
import sys

from conftest import ctrl_c_as_at_a_terminal

from nanopaged import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(tmp_path), HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "example.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_without_the_default_model_it_runs_on_random_weights(tmp_path):
    result = run_example(tmp_path, "--max-tokens", "48")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'Qwen/Qwen3-0.6B' is not a local directory" in result.stdout
    assert (
        "random-weight checkpoint" in result.stdout
        and "expect gibberish" in result.stdout
    )
    assert "4 requests" in result.stdout and "from the prefix cache" in result.stdout


def test_enforce_eager_is_the_reading_mode(tmp_path):
    result = run_example(tmp_path, "--max-tokens", "16", "--enforce-eager")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "(cpu attention, eager: no graphs)" in result.stdout
    plain = run_example(tmp_path, "--max-tokens", "16")
    assert "(cpu attention)" in plain.stdout


def test_a_model_that_cannot_be_loaded_is_an_error_not_random_text(tmp_path):
    result = run_example(tmp_path, "--model", "someone/missing-model")
    assert result.returncode != 0
    assert (
        "error: model 'someone/missing-model' is not a local directory" in result.stderr
    )
    assert "random-weight" not in result.stdout


def test_a_path_that_does_not_exist_says_so(tmp_path):
    result = run_example(tmp_path, "--model", "/nonexistent")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "error: model '/nonexistent': no such directory"


def test_stream_prints_the_answer_that_generate_gives(tmp_path, qwen3_path):
    result = run_example(
        tmp_path, "--model", qwen3_path, "--stream", "--max-tokens", "16"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    sys.path.insert(0, ROOT)
    import example

    llm = LLM(qwen3_path)
    prompt = llm.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": example.SYSTEM},
            {"role": "user", "content": example.QUESTIONS[0]},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    params = SamplingParams(temperature=0.6, top_p=0.95, max_tokens=16, seed=0)
    [output] = llm.generate(prompt, params, use_tqdm=False)
    assert result.stdout == output.outputs[0].text + "\n"


def test_help_names_the_default_model_and_the_stand_in(tmp_path):
    result = run_example(tmp_path, "--help")
    assert "Qwen/Qwen3-0.6B" in result.stdout and "gibberish by design" in result.stdout


def test_ctrl_c_and_a_request_too_long_for_the_pool_are_one_line_each(tmp_path):
    """Ctrl-C mid-run prints "interrupted", as a command-line tool does; a --max-tokens
    the stand-in's small pool cannot hold is an error that names the flag to change
    (no traceback for either)."""
    env = dict(os.environ, HOME=str(tmp_path), HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    process = subprocess.Popen(
        [sys.executable, "-u", "example.py", "--max-tokens", "300"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )
    while "random-weight checkpoint" not in process.stdout.readline():  # it has begun
        assert process.poll() is None
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1
    assert "Traceback" not in stderr and stderr.splitlines()[-1] == "interrupted"
    result = run_example(tmp_path, "--max-tokens", "100000")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "\nerror: request needs up to" in "\n" + result.stderr
    assert "give a smaller --max-tokens" in result.stderr
