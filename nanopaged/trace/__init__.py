"""A trace of every step the engine runs, and a page that plays it back.

`LLM(model, trace="run.jsonl")` (`--trace PATH` on example.py, bench.py and `nanopaged
serve`) writes the trace; `python -m nanopaged.trace run.jsonl -o run.html` writes one
self-contained HTML page (no network) that plays it back: the block pool, the queues,
the events of each step. The trace reads the engine through two seams: the runner it is
handed (it sees each `ScheduledStep` after scheduling, before the model runs) and
`LLM.run_step`, after each step; then it reads, never changes, the state the core's
docstrings name: the scheduler's queues (`waiting`, `running`), the sequences' block
tables, and the pool's `hashes`, `uncommitted` and `num_free_blocks`. Without `trace`,
none of this runs.

One JSON object a line. The first, the header: `trace` ("nanopaged"), `version` (1),
`model`, `tokenizer` (its path), `num_blocks`, `block_size`, `max_num_batched_tokens`,
`max_num_seqs`, `sliding_window` (None: none, or not on every layer). Then one line per
step (sequences by their `seq_id`, as strings where they are keys):
- `step`: its number, from 0; `seconds`: its wall time (scheduling, the model, sampling,
  the requests' bookkeeping), the tracing's own time left out; `error`: why it failed,
  if it did (every sequence is then aborted and its blocks freed).
- `budget`: `max_num_batched_tokens`; `tokens`: the tokens it ran, proposals included.
- `ran`: one `[seq, start, tokens, kind, proposed, accepted]` per sequence it ran:
  `tokens` tokens from position `start`, `kind` "prefill" (a prompt, or a chunk of one,
  or a preempted sequence's recompute) or "decode"; `proposed` speculative tokens, of
  which `accepted` kept.
- `running`, `waiting`: the scheduler's queues after the step.
- `tables`: the block table of each sequence whose table changed, as it is after the
  step (-1: a block given back, before a sliding window); `[]` when the sequence let go
  of its blocks.
- `hits`: by sequence admitted in the step, the blocks the prefix cache served it.
- `allocated`: blocks handed out from the free list (hits apart); `freed`: blocks back
  on it.
- `cached`: blocks entered in the prefix cache; `evicted`: cached blocks whose prefix
  was forgotten: handed out again, or by a failed step, or by `reset_prefix_cache`
  before the step. No block is ever copied: samples share full blocks only.
- `preempted`: sequences preempted for want of a free block (to be recomputed);
  `finished`: by sequence, "stop", "length" or "abort".
- `new`: by sequence first seen, `request`, `sample`, `prompt_token_ids`, and `prompt`
  (its text, when it came as text).
- `sampled`: by sequence, the completion tokens the step added. `free`: free blocks
  after the step.
The page decodes the tokens with the model's tokenizer when it is written (`text`, by
sequence, in each step it holds), so that tracing costs the engine no detokenizing.
"""

import argparse
import itertools
import json
import os
import time
import weakref

from nanopaged.checkpoint import load_tokenizer
from nanopaged.core.model_runner import ModelRunner
from nanopaged.core.sequence import Sequence
from nanopaged.core.step import Launched, SamplerOutput, ScheduledStep
from nanopaged.outputs import Detokenizer
from nanopaged.sampling_params import SamplingParams

NO_BLOCKS: list[int] = []  # never changed
NO_SEQUENCES: list[Sequence] = []
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page.html")


class TracedRunner:
    """The engine's runner, seen by a tracer: each step is noted before the model runs
    it. Anything else (what the engine, its proposers and any feature read of a
    runner) is the runner's own."""

    def __init__(self, runner: ModelRunner, tracer: "Tracer"):
        self.runner = runner
        self.tracer = tracer

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def launch(self, step: ScheduledStep, pending=None) -> Launched:
        self.tracer.scheduled(step)
        return self.runner.launch(step, pending)

    def close(self) -> None:
        self.tracer.close()
        self.runner.close()


class Tracer:
    """Writes the trace of one engine (see the module's docstring)."""

    def __init__(self, path: str, llm):
        self.file = open(path, "w")
        self.owners, self.tokenizer = llm.owners, llm.inputs.tokenizer.name_or_path
        # the engine, once `attach` is called (weakly: no cycle)
        self.engine = lambda: None
        self.num_steps = 0
        self.started = 0.0
        self.own_time = 0.0
        self.new_cached: set[int] = set()  # entered in the running step
        self.tables: dict[Sequence, list[int]] = {}  # as last written
        self.refs: dict[int, int] = {}  # block -> the written tables that hold it
        self.cached: set[int] = set()
        self.running: set[Sequence] = set()  # as the last step left them
        # completion tokens written, by sequence
        self.num_tokens: dict[Sequence, int] = {}
        self.record: dict = {}

    def attach(self, engine, config) -> None:
        self.engine = weakref.ref(engine)
        pool = engine.block_manager
        self._write(
            dict(
                trace="nanopaged",
                version=1,
                model=config.model,
                tokenizer=self.tokenizer,
                num_blocks=pool.num_blocks,
                block_size=pool.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                sliding_window=pool.sliding_window,
            )
        )

    def begin(self) -> None:
        self.started = time.perf_counter()
        self.own_time = 0.0
        self.record = self._empty()
        self.new_cached = set()
        # a block whose hash was forgotten between steps: a reset
        hashes = self.engine().block_manager.hashes
        forgotten = {b for b in self.cached if hashes[b] is None}
        self.record["evicted"] = sorted(forgotten)
        self.cached -= forgotten

    def scheduled(self, step: ScheduledStep) -> None:
        """After scheduling: what ran, the blocks each sequence got, hit, or let go
        of."""
        started = time.perf_counter()
        engine, record = self.engine(), self.record
        pool, size = engine.block_manager, engine.block_manager.block_size
        record["tokens"] = step.num_scheduled_tokens
        record["preempted"] = [seq.seq_id for seq in step.preempted]
        for seq, start, n in zip(step.seqs, step.starts, step.num_tokens):
            # a sequence preempted and admitted again in the step recomputes, even one
            # token
            decode = n == 1 and seq in self.running and seq not in step.preempted
            record["ran"].append(
                [seq.seq_id, start, n, "decode" if decode else "prefill", 0, 0]
            )
            # admitted
            if (seq not in self.tables or seq in step.preempted) and seq.block_table:
                record["hits"][str(seq.seq_id)] = seq.block_table[: start // size]
        self._note_tables(engine, step.seqs, step.preempted)
        self._note_cached(pool)  # entered while scheduling
        self.own_time += time.perf_counter() - started

    def stepped(
        self,
        step: ScheduledStep | None,
        sampled: SamplerOutput | None,
        error: BaseException | None = None,
    ) -> None:
        """After the step (or its failure): its outputs, the blocks its sequences let go
        of, the queues; writes the step's line."""
        ended, engine, record = time.perf_counter(), self.engine(), self.record
        if error is None and step.seqs:
            self._note_samples(step, sampled)
        self._note_tables(engine, step.seqs if step else [])
        if error is None:
            # entered after the forward (proposals')
            self._note_cached(engine.block_manager)
        else:  # the step's hashes are forgotten, its sequences aborted
            record["error"] = f"{type(error).__name__}: {error}"
            forgotten = {
                b for b in self.cached if engine.block_manager.hashes[b] is None
            }
            record["cached"] = [b for b in record["cached"] if b not in forgotten]
            record["evicted"] += sorted(
                forgotten - set(record["cached"]) - self.new_cached
            )
            self.cached -= forgotten
        scheduler = engine.scheduler
        self.running = set(scheduler.running)
        record.update(
            running=[s.seq_id for s in scheduler.running],
            waiting=[s.seq_id for s in scheduler.waiting],
            free=engine.block_manager.num_free_blocks,
        )
        record["seconds"] = ended - self.started - self.own_time
        if step is None or step.seqs or error is not None:
            self._write(record)
            self.num_steps += 1

    def close(self) -> None:
        self.file.close()

    def _empty(self) -> dict:
        return dict(
            step=self.num_steps,
            seconds=0.0,
            budget=self.engine().config.max_num_batched_tokens,
            tokens=0,
            ran=[],
            running=[],
            waiting=[],
            tables={},
            hits={},
            allocated=[],
            freed=[],
            cached=[],
            evicted=[],
            preempted=[],
            finished={},
            new={},
            sampled={},
            free=0,
        )

    def _note_samples(self, step: ScheduledStep, sampled: SamplerOutput) -> None:
        """Proposals kept, and the tokens added."""
        if step.proposals:
            by_seq = {entry[0]: entry for entry in self.record["ran"]}
            for r, (i, seq) in enumerate(
                zip(step.sampling_indices, step.sampling_seqs)
            ):
                proposed = len(step.proposals.get(i, ()))
                by_seq[seq.seq_id][4:] = proposed, len(sampled.token_ids[r]) - 1
        num_tokens, added = self.num_tokens, self.record["sampled"]
        for seq in step.sampling_seqs:
            written = num_tokens.get(seq)
            if (
                written is not None
                and len(seq.token_ids) > seq.num_prompt_tokens + written
            ):
                added[str(seq.seq_id)] = seq.token_ids[
                    seq.num_prompt_tokens + written :
                ]
                num_tokens[seq] = len(seq.token_ids) - seq.num_prompt_tokens

    def _note_cached(self, pool) -> None:
        """The blocks entered in the prefix cache since the step's last commit, but
        those noted already."""
        new = [b for b in pool.uncommitted if b not in self.cached]
        self.record["cached"] += new
        self.cached.update(new)
        self.new_cached.update(new)

    def _note_tables(
        self, engine, seqs: list[Sequence], preempted: list[Sequence] = NO_SEQUENCES
    ) -> None:
        """The tables that changed since they were last written, and so the blocks
        handed out (but for hits) and given back, with the cached ones handed out again;
        also those of a sequence preempted and admitted again, whose table may look
        unchanged."""
        record, scheduler, tables = self.record, engine.scheduler, self.tables
        taken, released = {}, {}
        # the running ones hold blocks or run now; one met twice is unchanged the second
        # time
        for seq in itertools.chain(seqs, scheduler.waiting, list(tables)):
            if seq not in self.num_tokens:
                self._introduce(seq)
            old = tables.get(seq, NO_BLOCKS)
            if old == seq.block_table:
                continue
            new = list(seq.block_table)
            record["tables"][str(seq.seq_id)] = new
            for block in set(new) - set(old) - {-1}:
                taken[block] = taken.get(block, 0) + 1
            for block in set(old) - set(new) - {-1}:
                released[block] = released.get(block, 0) + 1
            if new:
                tables[seq] = new
            else:
                del tables[seq]
                self._ended(seq)
        hits = {b for blocks in record["hits"].values() for b in blocks}
        for block in released.keys() | taken.keys():
            # old holders that stay
            left = self.refs.get(block, 0) - released.get(block, 0)
            if released.get(block) and not left:
                record["freed"].append(block)
            # a free block's cached prefix
            revived = block in hits and block in self.cached
            if taken.get(block) and not left and not revived:
                record["allocated"].append(block)
                if block in self.cached:
                    record["evicted"].append(block)
                    self.cached.discard(block)
            self.refs[block] = left + taken.get(block, 0)
        pool = engine.block_manager
        for block in {b for seq in preempted for b in seq.block_table}:
            if block in self.cached and pool.hashes[block] is None:  # handed out again
                record["evicted"].append(block)
                self.cached.discard(block)

    def _introduce(self, seq: Sequence) -> None:
        if seq not in self.owners or seq.finish_reason:
            return
        request, sample = self.owners[seq]
        self.record["new"][str(seq.seq_id)] = dict(
            request=request.request_id,
            sample=sample,
            prompt=request.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
        )
        self.num_tokens[seq] = seq.num_completion_tokens

    def _ended(self, seq: Sequence) -> None:
        """`seq` let go of its blocks: it finished (or was preempted: see
        `scheduled`)."""
        if seq.finish_reason is not None:
            self.record["finished"][str(seq.seq_id)] = seq.finish_reason
            self.num_tokens.pop(seq, None)

    def _write(self, line: dict) -> None:
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


def read_trace(path: str) -> tuple[dict, list[dict]]:
    """The header and the steps of a trace file."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("trace") != "nanopaged":
        raise ValueError(
            f"{path!r} is not a nanopaged trace (its first line has no "
            f'"trace": "nanopaged")'
        )
    return lines[0], lines[1:]


def add_text(header: dict, steps: list[dict]) -> None:
    """Gives each step the text its tokens added (`text`, by sequence), and each new
    sequence its prompt's text, decoded with the model's tokenizer (token ids, without
    it)."""
    try:
        tokenizer = load_tokenizer(header["tokenizer"])
    except (OSError, ValueError):
        tokenizer = None
    sequences: dict[str, tuple[Sequence, Detokenizer | None]] = {}
    for step in steps:
        step["text"] = {}
        for seq_id, info in step["new"].items():
            seq = Sequence(info["prompt_token_ids"], SamplingParams(max_tokens=None))
            if info["prompt"] is None:
                info["prompt"] = (
                    tokenizer.decode(seq.token_ids) if tokenizer else str(seq.token_ids)
                )
            sequences[seq_id] = (
                seq,
                tokenizer
                and Detokenizer(
                    tokenizer, SamplingParams(max_tokens=None), seq.token_ids
                ),
            )
        for seq_id, tokens in step["sampled"].items():
            seq, detokenizer = sequences[seq_id]
            seq.token_ids += tokens
            seq.finish_reason = step["finished"].get(seq_id)
            if detokenizer is None:
                step["text"][seq_id] = " ".join(map(str, tokens)) + " "
                continue
            before = len(detokenizer.text)
            detokenizer.update(seq)
            step["text"][seq_id] = detokenizer.text[before:]


def write_page(trace_path: str, page_path: str) -> str:
    """Writes the page that plays the trace back; returns its path."""
    header, steps = read_trace(trace_path)
    add_text(header, steps)
    data = json.dumps(dict(header=header, steps=steps)).replace("</", "<\\/")
    with open(PAGE) as f:
        page = f.read().replace("/*TRACE*/null", data)
    with open(page_path, "w") as f:
        f.write(page)
    return page_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m nanopaged.trace",
        description="Write the page that plays a nanopaged trace back (one HTML file).",
    )
    parser.add_argument(
        "trace", help="a trace written by LLM(..., trace=PATH) or --trace PATH"
    )
    parser.add_argument(
        "-o", "--output", help="the page (default: the trace's name, .html)"
    )
    args = parser.parse_args(argv)
    output = args.output or os.path.splitext(args.trace)[0] + ".html"
    try:
        print(f"wrote {write_page(args.trace, output)}")
    except (OSError, ValueError) as error:
        parser.exit(1, f"error: {error}\n")
