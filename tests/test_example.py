"""`python example.py` runs to completion on a machine with no model and no network."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_example_runs_offline(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "example.py", "--max-tokens", "48"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "running on a random-weight checkpoint" in result.stdout
    assert "4 requests" in result.stdout and "from the prefix cache" in result.stdout
