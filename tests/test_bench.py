"""bench.py runs end to end on CPU and its flags do what they say (no timing is
asserted)."""

import importlib
import importlib.util
import json
import os
import re
import shlex
import sys

import pytest
from transformers import AutoConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench.py and benchmarks/ are importable by name, as bench.py runs them
sys.path.insert(0, ROOT)
from benchmarks import floor, throughput, workload  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("bench")


@pytest.fixture
def figures(monkeypatch) -> list:
    """The matplotlib figures bench saves, as they are saved."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    saved, savefig = [], Figure.savefig
    monkeypatch.setattr(
        Figure,
        "savefig",
        lambda fig, *a, **k: saved.append(fig) or savefig(fig, *a, **k),
    )
    return saved


def assert_png(path, size: tuple[int, int]) -> None:
    """A PNG of `size` pixels (width, height), not all one colour."""
    from matplotlib.image import imread

    image = imread(str(path))
    assert image.shape[1::-1] == size and image.std() > 0


def test_every_command_the_docs_quote_parses(bench):
    """The `python bench.py ...` commands of the README and docs/, inline or in their
    blocks, name flags bench.py has, with values it takes."""
    from test_readme import PAGES

    quoted = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read().replace("\\\n", " ")
        quoted += re.findall(r"`python bench\.py([^`]*)`", text)
        quoted += re.findall(r"^ {0,4}python bench\.py(.*)$", text, re.M)
    assert len(quoted) >= 10
    for arguments in quoted:
        bench.parse_args(shlex.split(" ".join(arguments.split("#")[0].split())))


def test_every_command_the_gpu_script_runs_parses(bench):
    """benchmarks/gpu/run.sh runs only on a lent GPU: its bench.py commands at least
    name flags bench.py has."""
    with open(os.path.join(ROOT, "benchmarks", "gpu", "run.sh")) as f:
        script = f.read().replace("\\\n", " ").replace("$OUT", "/tmp")
    commands = re.findall(r"python3 bench\.py ([^;\n]*)", script)
    assert len(commands) >= 8
    for arguments in commands:
        bench.parse_args(shlex.split(arguments))


def test_throughput_with_peers(
    bench, qwen3_path, tmp_path, capsys, monkeypatch, figures
):
    """Each engine on the same workload, a row printed as soon as it finishes (before
    the next engine starts); the JSON and the plot of the results."""
    out, order = tmp_path / "bench.json", []
    run_engine = throughput.run_engine

    def recording(engine, *args):
        order.append((engine, capsys.readouterr().out))
        return run_engine(engine, *args)

    monkeypatch.setattr(throughput, "run_engine", recording)
    result = bench.main(
        [
            "--tiny",
            "--model",
            qwen3_path,
            "--no-progress",
            "--engines",
            "nanopaged,hf-static,nano-vllm",
            "--prefix-len",
            "16",
            "--out",
            str(out),
            "--plot",
            str(tmp_path / "bench.png"),
        ]
    )
    assert order[1][0] == "hf-static" and order[1][1].splitlines()[-1].startswith(
        "nanopaged "
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    nano = result["engines"]["nanopaged"]
    assert nano["output_tokens"] == result["workload"]["output_tokens"]
    # every prompt after the first finds the shared 16 tokens (a block) cached
    work = workload.make_workload(
        bench.parse_args(["--tiny", "--prefix-len", "16"]), 512
    )
    prompt_tokens = sum(map(len, work.prompts))
    assert nano["prefix_hit_rate"] == pytest.approx(
        16 * (len(work.prompts) - 1) / prompt_tokens
    )
    largest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens))
    assert nano["kv_blocks"] * 16 >= largest and nano["preemptions"] == 0
    # the timed run's steps, by phase: a sequence gets a token per decode step
    phases = nano["phases"]
    assert list(phases) == list(workload.PHASES) and phases["prefill"]["steps"] >= 1
    decode_steps = sum(p["steps"] for p in phases.values()) - phases["prefill"]["steps"]
    assert decode_steps >= max(work.output_lens) - 1
    assert sum(p["seconds"] for p in phases.values()) <= nano["elapsed"]
    assert (
        result["engines"]["hf-static"]["output_tokens"]
        == result["workload"]["output_tokens"]
    )
    assert (
        "elapsed" in result["engines"]["nano-vllm"]
        or "skipped" in result["engines"]["nano-vllm"]
    )
    assert result["floor"]["seconds"] > 0 and result["device"]["dtype"] == "float32"
    assert_png(tmp_path / "bench.png", (720, 480))
    [bars] = [fig.axes[0] for fig in figures]
    plotted = {
        t.get_text(): b.get_height()
        for t, b in zip(bars.get_xticklabels(), bars.patches)
    }
    engines = result["engines"]
    assert plotted == {
        k: v["output_tok_per_s"] for k, v in engines.items() if "output_tok_per_s" in v
    }


def test_another_checkout_runs_beside_this_one(bench, qwen3_path, tmp_path):
    """`nanopaged@CHECKOUT` runs that checkout's package in its own process (before
    and after in one run), this one's beside it; a path that is no checkout is an
    error row, and the other engines run."""
    import shutil

    other = tmp_path / "old"
    shutil.copytree(
        os.path.join(ROOT, "nanopaged"),
        other / "nanopaged",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    engines = f"nanopaged@{tmp_path}:torch,nanopaged@{other}:torch,nanopaged:torch"
    result = bench.main(
        ["--tiny", "--model", qwen3_path, "--no-progress", "--engines", engines]
    )
    ran = result["engines"]
    assert "not a checkout" in ran.pop(f"nanopaged@{tmp_path}:torch")["error"]
    assert ran[f"nanopaged@{other}:torch"]["checkout"] == str(other)
    assert ran["nanopaged:torch"]["checkout"] == ROOT
    tokens = {r["output_tokens"] for r in ran.values()}
    assert tokens == {result["workload"]["output_tokens"]}


def test_rounds_alternate_the_order_and_pair_the_ratios(bench, qwen3_path, monkeypatch):
    """`--rounds 3`: the engines run three times, the second round in reverse; each
    result is its run of median time, with every round's time and its ratio to the
    first nanopaged engine's run of the same round."""
    order, run_engine = [], throughput.run_engine

    def recording(engine, *args):
        order.append(engine)
        return run_engine(engine, *args)

    monkeypatch.setattr(throughput, "run_engine", recording)
    engines = ["nanopaged:torch", "nanopaged:cpu"]
    result = bench.main(
        ["--tiny", "--model", qwen3_path, "--no-progress", "--rounds", "3"]
        + ["--engines", ",".join(engines)]
    )
    assert order == engines + engines[::-1] + engines
    base, other = (result["engines"][e] for e in engines)
    assert base["ratio_rounds"] == [1.0, 1.0, 1.0]
    assert other["ratio_rounds"] == [
        b / o for b, o in zip(base["elapsed_rounds"], other["elapsed_rounds"])
    ]
    for r in (base, other):
        assert r["elapsed"] == sorted(r["elapsed_rounds"])[1]


def test_a_mixture_of_experts_runs_with_its_own_floor(bench, model_path):
    """`--model` a Qwen3-MoE checkpoint: nanopaged and transformers run it; the floor
    counts the weights a token runs (its top_k experts), not all of them."""
    path = model_path("qwen3-moe")
    result = bench.main(
        [
            "--tiny",
            "--model",
            path,
            "--no-progress",
            "--num-requests",
            "4",
            "--engines",
            "nanopaged,hf-static",
        ]
    )
    for engine in ("nanopaged", "hf-static"):
        assert (
            result["engines"][engine]["output_tokens"]
            == result["workload"]["output_tokens"]
        )
    c = json.load(open(f"{path}/config.json"))
    attention = (
        c["hidden_size"]
        * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
        * c["head_dim"]
    )
    two_experts = 2 * 3 * c["hidden_size"] * c["moe_intermediate_size"]  # of 8
    assert (
        floor.model_shape(path)["active_params"]
        == c["num_hidden_layers"] * (attention + two_experts)
        + c["vocab_size"] * c["hidden_size"]
    )


def test_the_step_clock_counts_decode_steps_by_batch_band():
    clock = workload.StepClock(lambda kind, batch: (kind, batch), lambda step: step)
    calls = [("prefill", 300), ("decode", 16), ("decode", 17), ("decode", 128)]
    for call in calls + [("decode", 129), ("decode", 256)]:
        assert clock(*call) == call
    assert {kind: p["steps"] for kind, p in clock.phases().items()} == {
        "prefill": 1,
        "decode b<=16": 1,
        "decode b<=64": 1,
        "decode b<=128": 1,
        "decode b>128": 2,
    }


def test_the_floor_counts_the_bytes_the_weights_are_kept_in():
    """Quantized projections at their kept size where a GPU keeps them so (4-bit
    AWQ/GPTQ with a scale and a zero point per group; FP8 per channel with dynamic
    activations in bfloat16), dequantized otherwise; the LM head in the model's dtype
    always."""
    shape = dict(active_params=1000 + 100, lm_head_params=100)

    def kept(quant, dtype_bytes=2, on_gpu=True):
        return floor.weight_bytes(dict(shape, quantization=quant), dtype_bytes, on_gpu)

    awq = {"quant_method": "awq", "group_size": 128}
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert kept(None) == kept(awq, on_gpu=False) == kept(fp8, dtype_bytes=4) / 2 == 2200
    assert kept(awq) == 1000 * (0.5 + 3 / 128) + 200
    assert kept(fp8) == 1000 + 200
    assert (
        kept(dict(fp8, weight_block_size=[128, 128]))
        == kept(dict(fp8, activation_scheme="static"))
        == 2200
    )
    channel = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "group_0": {
                "weights": {"strategy": "channel"},
                "input_activations": {"dynamic": True},
            }
        },
    }
    assert kept(channel) == 1200


def test_the_floor_takes_the_machines_fastest_run(monkeypatch, tmp_path):
    """A slow moment while measuring must not lower the rates (and lengthen the floor):
    the fastest of the runs counts, where an engine's step times take their median."""
    import torch

    monkeypatch.setattr(floor, "RATES_FILE", str(tmp_path / "rates.json"))
    picks = []

    def recording(fn, repeat=10, pick=workload.statistics.median):
        picks.append(pick)
        return pick([0.004, 0.001, 0.002])

    monkeypatch.setattr(floor, "repeated_time", recording)
    device = floor.measure_device(torch.float32)
    assert picks and all(pick is min for pick in picks)
    assert device["bandwidth"] == 2 * (1 << 24) * 4 / 0.001
    times = iter([3.0, 1.0, 2.0])
    monkeypatch.setattr(workload, "timed", lambda fn: (next(times), None))
    # a step time: the median
    assert workload.repeated_time(lambda: None, repeat=3) == 2.0


def test_the_floor_keeps_the_fastest_rates_this_machine_has_shown(
    monkeypatch, tmp_path
):
    """A run measured in a slow spell gets the rates of an earlier, faster run here; a
    faster run raises them; another machine (or dtype) keeps its own."""
    monkeypatch.setattr(floor, "RATES_FILE", str(tmp_path / "cache" / "rates.json"))

    def run(bandwidth, flops, name="CPU, 2 threads"):
        return floor.fastest_seen(
            dict(
                device=name,
                gpu=False,
                dtype="float32",
                bandwidth=bandwidth,
                flops=flops,
            )
        )

    assert run(20e9, 0.12e12)["flops"] == 0.12e12
    slow = run(15e9, 0.07e12)
    assert (slow["bandwidth"], slow["flops"]) == (20e9, 0.12e12)
    faster = run(22e9, 0.10e12)
    assert (faster["bandwidth"], faster["flops"]) == (22e9, 0.12e12)
    assert run(1e9, 0.01e12, name="CPU, 1 threads")["flops"] == 0.01e12
    monkeypatch.setattr(floor.platform, "node", lambda: "another machine")
    assert run(1e9, 0.01e12)["flops"] == 0.01e12


def test_the_floor_reads_an_fp8_kv_cache_at_a_byte_an_element(bench):
    """`--kv-cache-dtype fp8`: nanopaged's K/V at one byte, a quarter of float32's."""
    args = bench.parse_args(["--tiny", "--kv-cache-dtype", "fp8"])
    work = workload.make_workload(args, 512)
    shape = dict(
        active_params=1100,
        lm_head_params=100,
        kv_elements_per_token=64,
        attention_flops_per_pair=0,
    )
    device = dict(gpu=False, bandwidth=1e9, flops=1e12)
    fp8, fp32 = (
        floor.physical_floor(shape, work, device, 4, kv)["kv_bytes"] for kv in (1, 4)
    )
    assert fp32 == 4 * fp8 > 0


def test_a_preset_sets_defaults_and_flags_win(bench):
    args = bench.parse_args(["--tiny", "--num-requests", "3", "--prompt-len", "5", "6"])
    assert (args.num_requests, args.prompt_len, args.output_len) == (3, [5, 6], [8, 32])
    args = bench.parse_args(["--cpu", "--output-len", "1", "2"])
    assert (args.num_requests, args.prompt_len, args.output_len) == (
        48,
        [64, 512],
        [1, 2],
    )
    assert args.engines == "nanopaged,hf-static,hf" and args.preset == "cpu"
    assert bench.parse_args([]).num_requests == 256


def test_plot_without_matplotlib_says_how_to_get_it(bench, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a),
    )
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--plot", "x.png"])
    assert 'pip install -e ".[bench]"' in capsys.readouterr().err


def test_a_time_under_the_floor_is_never_a_share_above_100_percent(bench):
    assert floor.share_of_floor(1.0, 2.0) == "50% of the floor"
    assert (
        floor.share_of_floor(2.0, 1.0)
        == "under the floor: the floor model is wrong here"
    )
    # a floor too small to mean anything is not shown: no "0% of the floor"
    assert floor.share_of_floor(0.001, 2.0) == floor.share_of_floor(0.5, 100.0) == ""


def test_rows_come_as_engines_finish_and_the_missing_are_listed_last(qwen3_path):
    """Run as a person runs it: each engine's row is printed when it is done, before the
    next engine starts; an engine that is not installed is one line at the end; no floor
    of 0."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [
            sys.executable,
            "bench.py",
            "--tiny",
            "--model",
            qwen3_path,
            "--no-progress",
            "--engines",
            "nanopaged,vllm,hf-static",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    rows = [  # the table: up to the first blank line
        line.split()[0]
        for line in lines[: lines.index("")]
        if len(line.split()) > 2 and line.split()[1].replace(".", "").isdigit()
    ]
    assert rows == ["nanopaged", "hf-static"]  # vllm has no row of its own
    assert lines[-1] == "not run: vllm: vllm is not importable"
    assert "0.00 s" not in result.stdout and " 0% of the floor" not in result.stdout


def test_step_times(bench, qwen3_path, tmp_path, figures):
    result = bench.main(
        [
            "--tiny",
            "--model",
            qwen3_path,
            "--steps",
            "--backends",
            "torch",
            "--plot",
            str(tmp_path / "steps.png"),
        ]
    )
    kinds = [row["kind"] for row in result["steps"]]
    assert kinds == ["decode b=1", "decode b=4", "prefill 128 tok"]
    # each row measured the step it names: b sequences decoding, or 2 prompts of 64
    # tokens
    assert [row["tokens"] for row in result["steps"]] == [1, 4, 128]
    assert_png(tmp_path / "steps.png", (720, 480))
    [line] = figures[0].axes[0].get_lines()  # one backend: decode tok/s by batch size
    decode = result["steps"][:2]
    assert list(line.get_xdata()) == [1, 4]
    assert list(line.get_ydata()) == [r["tokens"] / (r["ms"] / 1e3) for r in decode]


def test_the_step_floors_count_what_each_step_must_do(bench, qwen3_path, monkeypatch):
    """A prefill step's floor: the decoder's arithmetic for every token, the LM head's
    for each prompt's last token alone (the one it samples), and the attention's. A
    decode step's: the longer of its bytes and its arithmetic (on a device that
    multiplies slowly, the arithmetic)."""
    from benchmarks import steps

    rate = 1e9  # slow enough that a decode step's arithmetic outlasts its bytes
    monkeypatch.setattr(
        steps, "measure_device", lambda dtype: dict(flops=rate, bandwidth=1e11, gpu=0)
    )
    result = bench.main(
        ["--tiny", "--model", qwen3_path, "--steps", "--backends", "torch"]
        + ["--batch-sizes", "1", "--prefill-seqs", "2", "--context", "64"]
    )
    [prefill] = [row for row in result["steps"] if row["kind"].startswith("prefill")]
    assert (
        prefill["tokens"] == 128
    )  # both prompts in one step, whatever the batch sizes
    shape = floor.model_shape(qwen3_path)
    decoder = shape["active_params"] - shape["lm_head_params"]
    flops = (
        2 * decoder * 128
        + 2 * shape["lm_head_params"] * 2
        + shape["attention_flops_per_pair"] * 2 * 64**2 // 2
    )
    assert prefill["floor_ms"] == pytest.approx(flops / rate * 1e3)
    [decode] = [row for row in result["steps"] if row["kind"] == "decode b=1"]
    flops = 2 * shape["active_params"] + shape["attention_flops_per_pair"] * 64
    assert decode["floor_ms"] == pytest.approx(flops / rate * 1e3)


def test_step_times_fit_a_cpu_pool_at_a_larger_batch(bench, qwen3_path):
    """32 sequences of 300 tokens fit the CPU pool it sizes: the timed step decodes all
    32, the prefill step runs 3 prompts of 300 tokens, each timing is of that step."""
    result = bench.main(
        [
            "--tiny",
            "--model",
            qwen3_path,
            "--steps",
            "--backends",
            "cpu",
            "--batch-sizes",
            "32",
            "--context",
            "300",
            "--prefill-seqs",
            "3",
        ]
    )
    decode, prefill = result["steps"]
    assert (decode["backend"], decode["tokens"], prefill["tokens"]) == ("cpu", 32, 900)
    assert prefill["tok_per_s"] == pytest.approx(900 / (prefill["ms"] / 1e3))
    assert 0 < decode["floor_ms"] and 0 < decode["ms"]


def test_host_times(bench, qwen3_path):
    result = bench.main(["--tiny", "--model", qwen3_path, "--host"])
    kinds = [row["kind"] for row in result["host"]]
    assert kinds == [
        "decode b=1 block=16",
        "decode b=1 block=256",
        "decode b=4 block=16",
        "decode b=4 block=256",
    ]
    # every timed step was the engine's own step, giving each sequence its next token
    assert [row["tokens_per_step"] for row in result["host"]] == [1, 1, 4, 4]


def test_kernel_profiles_engine_beside_engine(bench, qwen3_path):
    """Each engine's decode step under torch.profiler (on a CPU: the top-level torch
    ops): the plain backend's step runs attention for each layer, the busy and idle
    times split the wall time, the costliest first; an engine without a profile says
    so."""
    result = bench.main(
        [
            "--tiny",
            "--model",
            qwen3_path,
            "--kernels",
            "--engines",
            "nanopaged:torch,hf",
            "--batch-sizes",
            "4",
            "--context",
            "40",
        ]
    )
    profile, hf = result["kernels"]["nanopaged:torch"], result["kernels"]["hf"]
    assert hf == {"skipped": "no kernel profile of hf"}
    assert profile["busy_ms"] + profile["idle_ms"] == pytest.approx(profile["wall_ms"])
    times = [kernel["ms"] for kernel in profile["kernels"]]
    assert times == sorted(times, reverse=True)
    calls = {kernel["name"]: kernel["calls"] for kernel in profile["kernels"]}
    layers = AutoConfig.from_pretrained(qwen3_path).num_hidden_layers
    assert calls["aten::scaled_dot_product_attention"] == layers
    assert profile["launches"] >= sum(calls.values())


def test_lora_off_on_and_with_adapters(bench, qwen3_path):
    result = bench.main(
        [
            "--tiny",
            "--model",
            qwen3_path,
            "--lora",
            "2",
            "--lora-rank",
            "4",
            "--no-progress",
        ]
    )
    rows = result["lora"]
    assert [r["lora"] for r in rows] == ["off", "on, base model", "2 adapters"]
    assert [r["loras"] for r in rows] == [None, [], [1, 2]]  # the adapters did run
    assert len({r["output_tokens"] for r in rows}) == 1 and rows[0]["vs_off"] == 1


def test_pooling_beside_sentence_transformers(bench, qwen3_path):
    pytest.importorskip("sentence_transformers")
    result = bench.main(["--tiny", "--model", qwen3_path, "--pooling", "--no-progress"])
    rows = result["pooling"]
    assert [r["engine"] for r in rows] == ["nanopaged", "sentence-transformers"]
    assert all(r["inputs"] == 8 and r["elapsed"] > 0 for r in rows)
    # the same vectors: the same checkpoint, pooling and inputs
    assert rows[1]["max_abs_diff"] < 1e-4 and rows[0]["max_abs_diff"] == 0
    assert rows[1]["vs_sentence_transformers"] == 1


def test_vision_beside_transformers(bench, tmp_path):
    """Image requests: the same tokens from both engines; each distinct image encoded
    once, and repeated images served in part by the prefix cache."""
    from nanopaged.random_checkpoint import write_random_vision_checkpoint

    model = write_random_vision_checkpoint(str(tmp_path / "vl"))
    argv = ["--tiny", "--model", model, "--vision", "--max-model-len", "1024"]
    rows = bench.main(argv)["vision"]
    assert [r["engine"] for r in rows] == ["nanopaged", "hf"]
    assert all(r["requests"] == 8 and r["same_tokens"] == 8 for r in rows)
    assert rows[0]["images_encoded"] == 2 and rows[0]["prefix_hit_rate"] > 0.5
    assert rows[1]["speedup_vs_hf"] == 1


def test_serving_compares_both_policies(bench, qwen3_path, tmp_path, figures):
    result = bench.main(
        [
            "--tiny",
            "--model",
            qwen3_path,
            "--serve",
            "--num-requests",
            "6",
            "--request-rate",
            "8",
            "--long-prompt",
            "300",
            "--max-num-batched-tokens",
            "64",
            "--plot",
            str(tmp_path / "serve.png"),
        ]
    )
    assert list(result["serving"]) == ["nanopaged prefill-first", "nanopaged mixed"]
    for rates in result["serving"].values():
        run = rates[8.0]
        # the long prompt's one token is not counted with the workload's
        assert run["output_tokens"] == sum(
            workload.make_workload(
                bench.parse_args(["--tiny", "--num-requests", "6"]), 512
            ).output_lens
        )
        assert 0 < run["ttft_50_ms"] <= run["ttft_99_ms"]
        assert 0 < run["itl_50_ms"] <= run["itl_99_ms"] <= run["itl_max_ms"]
        assert run["long_prompt_ttft_ms"] > 0
    assert_png(tmp_path / "serve.png", (1200, 480))
    ttft, itl = figures[0].axes
    for ax, key in ((ttft, "ttft_99_ms"), (itl, "itl_99_ms")):
        lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
        assert lines == {
            server: [r[key] for r in rates.values()]
            for server, rates in result["serving"].items()
        }
