"""The step trace (nanopaged/trace/) agrees with the engine at every step, and its
page plays it back in a real browser (headless Chromium) without a JavaScript error."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import random_prompts
from test_example import run_example

from nanopaged import LLM, SamplingParams
from nanopaged.trace import Tracer, add_text, read_trace, write_page

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_SIZE = 16


class Replay:
    """The engine's state as the trace tells it, one line at a time (as the page
    does)."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}
        self.cached: set[int] = set()
        self.first_hits: dict[str, list[int]] = {}
        self.preemptions = 0

    def advance(self, step: dict) -> None:
        for seq, table in step["tables"].items():
            if table:
                self.tables[seq] = table
            else:
                self.tables.pop(seq, None)
        self.cached -= set(step["evicted"])
        self.cached |= set(step["cached"])
        for seq, blocks in step["hits"].items():
            self.first_hits.setdefault(seq, blocks)
        self.preemptions += len(step["preempted"])

    def in_use(self) -> set[int]:
        return {b for table in self.tables.values() for b in table if b >= 0}


def assert_step_agrees(llm: LLM, step: dict, replay: Replay) -> None:
    """The trace's state after a step's line is the engine's: the blocks in use, the
    tables, the cached blocks, the running queue."""
    pool = llm.engine.block_manager
    replay.advance(step)
    assert replay.in_use() == {b for b, count in enumerate(pool.ref_counts) if count}
    assert (
        len(replay.in_use())
        == pool.num_blocks - pool.num_free_blocks
        == pool.num_blocks - step["free"]
    )
    live = [
        s
        for s in (*llm.engine.scheduler.running, *llm.engine.scheduler.waiting)
        if s.block_table
    ]
    assert replay.tables == {str(s.seq_id): s.block_table for s in live}
    assert replay.cached == {b for b, h in enumerate(pool.hashes) if h is not None}
    assert step["running"] == [s.seq_id for s in llm.engine.scheduler.running]


def replayed(llm: LLM, path: str, run_step) -> tuple[Replay, list[dict]]:
    """Steps the engine with `run_step()` until it is finished, checking each step's
    line."""
    replay, steps = Replay(), []
    with open(path) as trace:
        trace.readline()  # the header
        while not llm.is_finished():
            run_step()
            steps.append(json.loads(trace.readline()))
            assert_step_agrees(llm, steps[-1], replay)
        assert trace.readline() == ""  # one line a step
    return replay, steps


@pytest.fixture(scope="module")
def traced_run(qwen3_path, tmp_path_factory):
    """Run a step at a time: two prompts sharing 40 tokens, a request of n=3 samples,
    four short ones; 14 blocks of 16 tokens (preemption) and 32 tokens a step (chunked
    prefill). After each step, the trace's state is checked against the engine's."""
    path = str(tmp_path_factory.mktemp("trace") / "run.jsonl")
    llm = LLM(
        qwen3_path,
        max_model_len=512,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=14,
        max_num_batched_tokens=32,
        trace=path,
    )
    shared = random_prompts([40], seed=30)[0]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for prompt in [shared + tail for tail in random_prompts([3, 25], seed=31)]:
        llm.add_request(prompt, greedy)
    llm.add_request(
        random_prompts([20], seed=32)[0],
        SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
    )
    for prompt in random_prompts([10] * 4, seed=33):
        llm.add_request(prompt, greedy)
    seqs = {str(seq.seq_id): seq for seq in llm.owners}
    pool, shared_seen, texts = llm.engine.block_manager, [False], {}
    header = read_trace(path)[0]

    def run_step():
        for output in llm.step():
            for sample, completion in enumerate(output.outputs):
                texts[(output.request_id, sample)] = completion.text
        shared_seen[0] |= any(count > 1 for count in pool.ref_counts)

    replay, _ = replayed(llm, path, run_step)
    llm.close()
    return dict(
        path=path,
        header=header,
        llm=llm,
        seqs=seqs,
        replay=replay,
        texts=texts,
        shared_seen=shared_seen[0],
    )


def test_a_failed_step_shows_its_cached_blocks_forgotten_not_both(qwen3_path, tmp_path):
    """Steps fail now and then (the model raises): the step's line has its error, the
    blocks whose hashes its rollback forgot are not listed cached, and the trace agrees
    with the engine at every step, through the failures and after."""
    from test_reliability import Boom, first_layer_raises

    path = str(tmp_path / "run.jsonl")
    llm = LLM(
        qwen3_path,
        max_model_len=512,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=14,
        max_num_batched_tokens=32,
        trace=path,
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls, errors = [], []

    def add_requests():
        for prompt in random_prompts([40, 20, 33], seed=len(calls)):
            llm.add_request(prompt, params)

    def run_step():
        try:
            llm.step()
        except Boom as error:  # every request was aborted: new ones
            errors.append(error)
            add_requests()

    forgotten = []  # the hashes each failed step had entered

    def should_fail(meta) -> bool:
        """Fails the 2nd and 4th steps with hashes to forget (after a first that
        runs)."""
        entered = set(llm.engine.block_manager.uncommitted)
        calls.append(bool(entered))
        if entered and sum(calls) in (2, 4):
            forgotten.append(entered)
            return True
        return False

    add_requests()
    with first_layer_raises(llm, Boom, should_fail):
        replay, steps = replayed(llm, path, run_step)
    failed = [s for s in steps if "error" in s]
    assert len(failed) == len(errors) == 2 and any(forgotten)
    for step, hashes in zip(failed, forgotten):
        assert not set(step["cached"]) & set(step["evicted"])
        assert not hashes & set(step["cached"])


def test_blocks_cached_by_accepted_proposals_are_on_their_steps_line(
    qwen3_path, tmp_path
):
    """Speculative decoding: a block filled by accepted proposals is cached in the step
    that accepted them (the trace agrees with the pool after every step)."""
    path = str(tmp_path / "run.jsonl")
    llm = LLM(
        qwen3_path,
        max_model_len=512,
        kvcache_block_size=4,
        num_kvcache_blocks=64,
        trace=path,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    )
    for prompt in ([5, 6, 7, 8] * 6, [9, 10] * 10):
        llm.add_request(
            prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        )
    replay, steps = replayed(llm, path, llm.step)
    assert llm.stats().num_accepted_tokens > 8
    assert sum(r[5] for s in steps for r in s["ran"]) == llm.stats().num_accepted_tokens


def test_mixed_scheduling_preempts_and_readmits_in_one_step_as_the_engine_does(
    qwen3_path, tmp_path
):
    """scheduling="mixed" can preempt a sequence while decoding and admit it again in
    the same step: it is traced as preempted and recomputed (prefill), as many
    preemptions as the engine's, and the blocks its admission handed out again lose
    their cached mark."""
    path = str(tmp_path / "run.jsonl")
    llm = LLM(
        qwen3_path,
        max_model_len=512,
        kvcache_block_size=4,
        num_kvcache_blocks=10,
        max_num_batched_tokens=8,
        scheduling="mixed",
        trace=path,
    )
    shared = random_prompts([4], seed=40)[0]  # greedy samples and prompts share blocks
    for tail, max_tokens, n in zip(
        random_prompts([6, 5, 2, 2, 4], seed=41), (6, 6, 18, 13, 11), (2, 2, 2, 2, 1)
    ):
        llm.add_request(
            shared + tail,
            SamplingParams(temperature=0, n=n, max_tokens=max_tokens, ignore_eos=True),
        )
    replay, steps = replayed(llm, path, llm.step)
    assert replay.preemptions == llm.stats().num_preemptions > 0
    readmitted = [(s, r) for s in steps for r in s["ran"] if r[0] in s["preempted"]]
    assert readmitted and all(r[3] == "prefill" for _, r in readmitted)


def test_the_trace_agrees_with_the_engine_at_every_step(traced_run):
    """(The checks of each step are in the fixture.) And over the run: its preemptions
    and prefix hits are the engine's, and it saw shared blocks and chunked prefills."""
    run = traced_run
    header, steps = read_trace(run["path"])
    assert header == run["header"] and header["num_blocks"] == 14
    assert header["block_size"] == BLOCK_SIZE and header["max_num_batched_tokens"] == 32
    assert run["replay"].preemptions == run["llm"].stats().num_preemptions > 0
    hits = {
        seq: len(blocks) * BLOCK_SIZE
        for seq, blocks in run["replay"].first_hits.items()
    }
    assert hits == {
        seq_id: seq.num_cached_tokens for seq_id, seq in run["seqs"].items()
    }
    assert sum(hits.values()) > 0 and run["shared_seen"]
    chunks = [r for s in steps for r in s["ran"] if r[3] == "prefill" and r[1] > 0]
    assert chunks and all(s["tokens"] <= s["budget"] for s in steps)
    assert sum(len(s["finished"]) for s in steps) == len(run["seqs"]) == 9
    assert all(s["step"] == i and s["seconds"] > 0 for i, s in enumerate(steps))


def test_each_sequence_is_introduced_and_the_page_text_is_the_outputs(traced_run):
    """The trace holds tokens; the page's text, decoded from them, is the outputs'."""
    header, steps = read_trace(traced_run["path"])
    new = {seq: info for s in steps for seq, info in s["new"].items()}
    assert set(new) == set(traced_run["seqs"])
    for seq, info in new.items():
        assert (
            info["prompt_token_ids"]
            == traced_run["seqs"][seq].token_ids[
                : traced_run["seqs"][seq].num_prompt_tokens
            ]
        )
    tokens = {}
    for s in steps:
        for seq, added in s["sampled"].items():
            tokens[seq] = tokens.get(seq, []) + added
    assert tokens == {
        seq: s.completion_token_ids for seq, s in traced_run["seqs"].items()
    }
    add_text(header, steps)
    text = {}
    for s in steps:
        for seq, delta in s["text"].items():
            text[seq] = text.get(seq, "") + delta
    for seq, info in new.items():
        assert (
            text.get(seq, "") == traced_run["texts"][(info["request"], info["sample"])]
        )


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip(
            "no Chromium to test the trace page in: install Debian's package "
            "(apt-get install chromium); .ci/run does"
        )
    return found


def open_page(
    page: str, fragment: str, screenshot: str | None = None
) -> tuple[str, str]:
    """Loads the page in headless Chromium, runs its script; returns the rendered DOM
    (or, with `screenshot`, saves one) and what the browser logged."""
    action = (
        [f"--screenshot={screenshot}", "--window-size=1400,900"]
        if screenshot
        else ["--dump-dom"]
    )
    result = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
            *action,
            f"file://{page}#{fragment}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, result.stderr


def no_javascript_error(dom: str, log: str) -> None:
    assert 'data-ready="true"' in dom, "the page's script did not finish"
    assert re.search(r'<pre id="errors" hidden="">\s*</pre>', dom), dom[:2000]
    assert "Uncaught" not in log, log


def test_the_page_plays_the_trace_in_a_browser(traced_run, tmp_path):
    page = write_page(traced_run["path"], str(tmp_path / "run.html"))
    steps = read_trace(traced_run["path"])[1]
    preempting = next(s for s in steps if s["preempted"])
    victim = str(preempting["preempted"][0])
    dom, log = open_page(page, f"step={preempting['step']}&seq={victim}")
    no_javascript_error(dom, log)
    assert f'data-step="{preempting["step"]}"' in dom
    assert len(re.findall(r'<div class="block[^"]*" data-block=', dom)) == 14
    events = re.findall(r'<li class="event (\w+)">([^<]*)</li>', dom)
    assert (
        "preempt",
        f"seq {victim} preempted: no free block for a running sequence's next "
        "token; its blocks are freed and it waits to be recomputed",
    ) in events
    # the sequence clicked on: its prompt and its completion so far
    assert 'id="prompt-text"' in dom and f"seq {victim}: request" in dom
    hit = next(s for s in steps if any(s["hits"].values()))
    dom, log = open_page(page, f"step={hit['step']}")
    no_javascript_error(dom, log)
    assert "hit" in re.findall(r'<li class="event (\w+)">', dom)
    open_page(page, f"step={hit['step']}", screenshot=str(tmp_path / "page.png"))
    assert (tmp_path / "page.png").stat().st_size > 10_000


def test_a_javascript_error_is_caught(traced_run, tmp_path):
    """The check above can fail: a step the script cannot read shows as an error."""
    header, steps = read_trace(traced_run["path"])
    broken = tmp_path / "broken.jsonl"
    del steps[0]["ran"]
    broken.write_text("\n".join(json.dumps(line) for line in [header, *steps]))
    dom, log = open_page(
        write_page(str(broken), str(tmp_path / "broken.html")), "step=0"
    )
    with pytest.raises(AssertionError):
        no_javascript_error(dom, log)


def test_without_a_trace_no_tracing_code_runs(qwen3_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tracing code ran")

    for name in ("__init__", "begin", "scheduled", "stepped"):
        monkeypatch.setattr(Tracer, name, refuse)
    llm = LLM(qwen3_path, max_model_len=256)
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and llm.tracer is None


def test_a_traced_runner_is_its_runner_but_for_the_steps_it_notes(qwen3_path, tmp_path):
    """What a feature reads of a runner (any attribute, one added tomorrow too) is
    the runner's own under a trace; only `launch` notes the step first."""
    from nanopaged.trace import TracedRunner

    llm = LLM(qwen3_path, max_model_len=256, trace=str(tmp_path / "run.jsonl"))
    traced = llm.engine.runner
    assert isinstance(traced, TracedRunner)
    for name in ("model", "kv_cache", "block_size", "num_kvcache_blocks", "sampler"):
        assert getattr(traced, name) is getattr(traced.runner, name)
    traced.runner.added_by_a_feature = object()
    assert traced.added_by_a_feature is traced.runner.added_by_a_feature


def test_a_failed_step_is_traced_and_the_engine_goes_on(
    qwen3_path, tmp_path, monkeypatch
):
    path = str(tmp_path / "run.jsonl")
    llm = LLM(qwen3_path, max_model_len=256, trace=path)
    runner, calls = llm.engine.runner.runner, []
    execute = runner.execute

    def failing(inputs, pending=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return execute(inputs, pending)

    monkeypatch.setattr(runner, "execute", failing)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(
            random_prompts([20, 30], seed=34),
            SamplingParams(max_tokens=8),
            use_tqdm=False,
        )
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()
    steps = read_trace(path)[1]
    [failed] = [s for s in steps if "error" in s]
    assert failed["error"] == "RuntimeError: injected"
    assert failed["free"] == llm.engine.block_manager.num_blocks
    assert all(table == [] for table in failed["tables"].values()) and failed["tables"]
    assert set(failed["finished"].values()) == {"abort"}
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert steps[-1]["finished"] and "error" not in steps[-1]


def test_a_reset_prefix_cache_is_traced_as_every_cached_block_evicted(
    qwen3_path, tmp_path
):
    path = str(tmp_path / "run.jsonl")
    llm = LLM(qwen3_path, max_model_len=256, kvcache_block_size=BLOCK_SIZE, trace=path)
    prompts, params = random_prompts([40, 40], seed=35), SamplingParams(max_tokens=4)
    llm.generate(prompts[:1], params, use_tqdm=False)
    assert llm.reset_prefix_cache()
    llm.generate(prompts[1:], params, use_tqdm=False)
    llm.close()
    replay, steps = Replay(), read_trace(path)[1]
    for step in steps:
        replay.advance(step)
    pool = llm.engine.block_manager
    assert replay.cached == {b for b, h in enumerate(pool.hashes) if h is not None}
    [reset] = [i for i, s in enumerate(steps) if s["evicted"]]
    assert steps[reset]["new"]  # the second run's first step
    assert (
        set(steps[reset]["evicted"])
        == {b for s in steps[:reset] for b in s["cached"]}
        != set()
    )


def test_the_command_writes_the_page_and_names_a_file_that_is_no_trace(
    traced_run, tmp_path
):
    command = [sys.executable, "-m", "nanopaged.trace"]
    result = subprocess.run(
        [*command, traced_run["path"], "-o", str(tmp_path / "p.html")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.stdout == f"wrote {tmp_path / 'p.html'}\n"
    page = (tmp_path / "p.html").read_text()
    assert "<script src" not in page and "http" not in page.split("<script>")[2]
    (tmp_path / "other.jsonl").write_text('{"something": 1}\n')
    result = subprocess.run(
        [*command, str(tmp_path / "other.jsonl")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 1 and "is not a nanopaged trace" in result.stderr
    assert "Traceback" not in result.stderr


def test_example_writes_the_trace_and_prints_its_page(tmp_path):
    trace = tmp_path / "example.jsonl"
    result = run_example(tmp_path, "--trace", str(trace))
    assert result.returncode == 0, result.stderr[-2000:]
    page = tmp_path / "example.html"
    assert (
        result.stdout.splitlines()[-1]
        == f"the steps: {trace}; the page that plays them back: {page}"
    )
    steps = read_trace(str(trace))[1]
    assert page.stat().st_size > 0 and sum(len(s["finished"]) for s in steps) == 4
    # the stand-in's small pool and budget show a prefix hit, a chunk and a preemption
    assert any(any(s["hits"].values()) for s in steps) and any(
        s["preempted"] for s in steps
    )
    assert any(
        kind == "prefill" and start > 0
        for s in steps
        for _, start, _, kind, *_ in s["ran"]
    )


def test_bench_and_serve_take_a_trace(qwen3_path, tmp_path):
    sys.path.insert(0, ROOT)
    import bench

    bench.main(
        [
            "--tiny",
            "--model",
            qwen3_path,
            "--no-progress",
            "--engines",
            "nanopaged",
            "--num-requests",
            "3",
            "--trace",
            str(tmp_path / "bench.jsonl"),
        ]
    )
    steps = read_trace(str(tmp_path / "bench.jsonl"))[1]
    introduced = sum(len(s["new"]) for s in steps)
    assert introduced >= 3 and sum(len(s["finished"]) for s in steps) == introduced
    from test_server import OPTIONS, Server

    server = Server(qwen3_path, *OPTIONS, "--trace", str(tmp_path / "serve.jsonl"))
    try:
        server.client.completions.create(model="tiny", prompt="Paged", max_tokens=5)
    finally:
        assert server.stop()
    steps = read_trace(str(tmp_path / "serve.jsonl"))[1]
    assert (
        steps[0]["ran"][0][3] == "prefill" and steps[0]["new"]["0"]["prompt"] == "Paged"
    )
    assert [len(s["finished"]) for s in steps].count(1) == 1


def test_each_data_parallel_replica_writes_its_own_trace(qwen3_path, tmp_path):
    with LLM(
        qwen3_path,
        max_model_len=256,
        data_parallel_size=2,
        trace=str(tmp_path / "run.jsonl"),
    ) as llm:
        llm.generate(
            random_prompts([10, 12, 14, 16], seed=35),
            SamplingParams(max_tokens=4),
            use_tqdm=False,
        )
    finished = [
        sum(len(s["finished"]) for s in read_trace(str(tmp_path / name))[1])
        for name in ("run.replica0.jsonl", "run.replica1.jsonl")
    ]
    assert (
        sum(finished) == 4
        and min(finished) > 0
        and not (tmp_path / "run.jsonl").exists()
    )
