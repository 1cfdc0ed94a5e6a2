"""The slot engine on a real (tiny) causal LM: the same tokens as ``model.generate`` and as the dynamic
engine, through chunked prefill, moves between slots and a full slot (speculation on both engines is
``test_generator``'s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kinfer.batcher import GenPolicy
from kinfer.consumers.runners.generator import GeneratorRunner, GenInput, Sampling, TokenEvent
from kinfer.consumers.runners.graphs import EagerSteps, step_graphs
from kinfer.consumers.runners.slotengine import PREFILL_ROWS
from kinfer.consumers.runners.tinylm import build_tiny_lm
from tests.unit.consumers.runners.test_generator import PROMPTS, drive, reference

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-lm"), eos=False, init=0.2)  # no EOS: lengths are the test's


def slot_runner(lm_dir: Path, **options: int) -> GeneratorRunner:
    # float64 keeps batched and single-row arithmetic equal far below any logit gap.
    runner = GeneratorRunner(lm_dir, dtype=torch.float64, engine="slots", **{"slots": 4, "context": 96, **options})
    runner.load()
    runner.warmup()
    return runner


def run_alone(runner: GeneratorRunner, rid: str, prompt: str, sampling: Sampling) -> list[TokenEvent]:
    events = runner.step([GenInput(rid, prompt, sampling)], [])
    while runner.batch is not None:
        events += runner.step([], [])
    return events


def test_greedy_tokens_match_generate_through_chunked_prefill_joins_and_leaves(lm_dir: Path) -> None:
    """Four slots, prompts prefilled seven tokens a step between decode steps, rows leaving from the
    middle (the last row moves into the hole) and joining late: every row's tokens are greedy decoding's."""
    runner = slot_runner(lm_dir, prefill_chunk=7)
    lengths = [12, 6, 20, 3, 9]
    arrivals = {
        0: [("r0", PROMPTS[0], lengths[0]), ("r1", PROMPTS[1], lengths[1])],
        2: [("r2", PROMPTS[2], lengths[2])],
        5: [("r3", PROMPTS[3], lengths[3]), ("r4", PROMPTS[4], lengths[4])],
    }
    tokens, finished, rows = drive(runner, arrivals, GenPolicy(max_running=4))
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
        assert tokens[f"r{i}"] == reference(runner, prompt, n), f"r{i} differs"
    assert max(rows) == 4 and runner.batch is None
    # r1's 14-token prompt took two steps of prefill: its last token came a step after r0's would have.
    assert finished["r1"] > lengths[1] - 1


def test_more_prompts_than_one_prefill_pass_takes_arrive_together(lm_dir: Path) -> None:
    runner = slot_runner(lm_dir, slots=12, prefill_chunk=4096)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(PREFILL_ROWS + 2)]
    arrivals = {0: [(f"p{i}", prompt, 5) for i, prompt in enumerate(prompts)]}
    tokens, _, rows = drive(runner, arrivals, GenPolicy(max_running=12))
    assert rows[0] == len(prompts)  # every one prefilled in the first step
    for i, prompt in enumerate(prompts):
        assert tokens[f"p{i}"] == reference(runner, prompt, 5), f"p{i} differs"


def test_a_long_prompt_is_prefilled_a_chunk_a_step_while_the_running_row_keeps_decoding(lm_dir: Path) -> None:
    runner = slot_runner(lm_dir, prefill_chunk=4)
    runner.step([GenInput("running", PROMPTS[2], Sampling(max_new_tokens=30))], [])
    long_prompt = PROMPTS[3]
    prompt_tokens = len(runner.tokenizer(long_prompt)["input_ids"])
    steps_until_first = 0
    produced = {"running": 1, "long": 0}
    admit = [GenInput("long", long_prompt, Sampling(max_new_tokens=5))]
    while produced["long"] == 0:
        events = runner.step(admit, [])
        admit = []
        steps_until_first += 1
        for e in events:
            produced[e.id] += 1
        assert any(e.id == "running" for e in events)  # never stalled behind the prompt
    assert steps_until_first == -(-prompt_tokens // 4)  # one chunk of four a step


def test_seeded_sampling_draws_the_same_tokens_as_the_dynamic_engine(lm_dir: Path) -> None:
    hot = Sampling(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=11)
    dynamic = GeneratorRunner(lm_dir, dtype=torch.float64)
    dynamic.load()
    slots = slot_runner(lm_dir)
    assert [e.token for e in run_alone(slots, "a", PROMPTS[1], hot)] == \
        [e.token for e in run_alone(dynamic, "a", PROMPTS[1], hot)]
    stopped = run_alone(slots, "b", PROMPTS[1], Sampling(max_new_tokens=16, temperature=1.0, seed=11, stop=("e",)))
    assert stopped[-1].finish in ("stop", "length") and "e" not in "".join(e.text for e in stopped)


def test_an_output_that_fills_its_slot_ends_with_length(lm_dir: Path) -> None:
    runner = slot_runner(lm_dir, context=24)
    prompt_tokens = len(runner.tokenizer(PROMPTS[0])["input_ids"])
    events = run_alone(runner, "full", PROMPTS[0], Sampling(max_new_tokens=100))
    # The prompt's columns, then one per fed token; the last token sampled is never fed.
    assert len(events) == 24 - prompt_tokens + 1
    assert events[-1].finish == "length"
    assert [e.token for e in events] == reference(runner, PROMPTS[0], len(events))


def test_a_cancelled_row_frees_its_slot_and_reset_forgets_every_row(lm_dir: Path) -> None:
    runner = slot_runner(lm_dir)
    runner.step([GenInput(f"r{i}", PROMPTS[i], Sampling(max_new_tokens=50)) for i in range(4)], [])
    assert runner.batch is not None and len(runner.batch) == 4
    runner.step([], ["r1"])
    assert runner.running == ["r0", "r3", "r2"]  # the last row took the hole
    runner.reset()
    assert runner.batch is None
    assert [e.token for e in run_alone(runner, "again", PROMPTS[0], Sampling(max_new_tokens=6))] == \
        reference(runner, PROMPTS[0], 6)


def test_the_decode_step_reads_and_writes_only_buffers_that_live_as_long_as_the_engine(lm_dir: Path) -> None:
    """What a captured graph needs: a replay reads and writes the addresses of its capture, so the step
    may never swap a buffer for a new tensor. Measured by address, across joins, leaves and moves."""
    runner = slot_runner(lm_dir, prefill_chunk=5)
    engine = runner._slots
    assert engine is not None and isinstance(engine.steps, EagerSteps)  # the CPU stands in for graphs

    def addresses() -> list[int]:
        buffers = [engine._ids, engine._positions, engine._logits, engine._open, *engine.cache.keys,
                   *engine.cache.values]
        return [t.data_ptr() for t in buffers]

    before = addresses()
    arrivals = {0: [("a", PROMPTS[1], 9), ("b", PROMPTS[0], 3)], 2: [("c", PROMPTS[3], 7)]}
    drive(runner, arrivals, GenPolicy(max_running=4), cancel_at={4: "a"})
    assert addresses() == before


def test_graphs_only_on_a_cuda_device() -> None:
    assert isinstance(step_graphs(lambda rows, columns: None, "cpu"), EagerSteps)
    assert isinstance(step_graphs(lambda rows, columns: None, "cuda:0", capture=False), EagerSteps)


def test_slot_options_are_checked(lm_dir: Path) -> None:
    with pytest.raises(ValueError, match="engine"):
        GeneratorRunner(lm_dir, engine="paged")
    with pytest.raises(ValueError, match="slots"):
        GeneratorRunner(lm_dir, engine="slots", slots=0)
    with pytest.raises(ValueError, match="positions"):
        GeneratorRunner(lm_dir, engine="slots", context=4096)  # the tiny LM has 2048
    assert GeneratorRunner(lm_dir, engine="slots", context=100, max_prompt_tokens=1024).max_prompt_tokens == 99
    assert GeneratorRunner(lm_dir, engine="slots").context == 2048
    short = lm_dir.parent / "short-lm"
    short.mkdir(exist_ok=True)
    (short / "config.json").write_text('{"n_positions": 1024}')  # GPT-2's key: a model shorter than the default
    assert GeneratorRunner(short, engine="slots").max_sequence_tokens == 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_decode_steps_give_the_eager_tokens(lm_dir: Path) -> None:
    graphs = GeneratorRunner(lm_dir, device="cuda", dtype=torch.float32, engine="slots", slots=4, context=96)
    eager = GeneratorRunner(lm_dir, device="cuda", dtype=torch.float32, engine="slots", slots=4, context=96,
                            graphs=False)
    tokens = []
    for runner in (graphs, eager):
        runner.load()
        runner.warmup()
        tokens.append([e.token for e in run_alone(runner, "g", PROMPTS[1], Sampling(max_new_tokens=20))])
    table = graphs._slots.table if graphs._slots is not None else None
    assert table is not None and graphs._slots.steps.captured == len(table.buckets) * len(table.windows)
    assert tokens[0] == tokens[1]


def test_the_footprint_counts_the_kv_block_with_the_weights(lm_dir: Path) -> None:
    dynamic = GeneratorRunner(lm_dir, dtype=torch.float64)
    dynamic.load()
    runner = slot_runner(lm_dir, slots=4, context=96)
    # 2 layers x keys and values x 4 slots x 2 KV heads x 96 columns x 16 dims x 8 bytes
    assert runner.footprint_bytes() - dynamic.footprint_bytes() == 2 * 2 * 4 * 2 * 96 * 16 * 8
