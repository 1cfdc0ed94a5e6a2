"""A batch's state under writers that read it stale (``producers.batchstate``).

The runner writes progress, ``finalizing`` and the end; any gateway writes a cancel. Each writer computes
its record from the state as it last read it, which may be several records old when its write lands, and
writes it joined with that state (``BatchStore.put_batch``). Every reader folds the records with ``merge``
in the order the topic holds them. Whatever the interleaving: a cancel, once read, is never lost, and the
batch ends ``cancelled`` (unless it failed); a terminal state is never left; the status never goes back.
"""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from kinfer.producers.batchstate import cancelled, ending, merge, stage
from kinfer.topics.batches import BatchObject, RequestCounts

BATCH = BatchObject("batch_" + "1" * 24, "t", "/v1/embeddings", "file-" + "2" * 24, 1, 2, "validating", b"k" * 16)
LINES = 10


def change(batch: BatchObject, kind: str, n: int) -> BatchObject:
    """What a writer writes, from the state it read."""
    if kind == "cancel":
        return cancelled(batch, 100 + n)
    if kind == "publish":
        return replace(batch, status="in_progress", published=True, in_progress_at=10,
                       request_counts=RequestCounts(LINES))
    if kind == "progress":
        ended = min(n, LINES)
        return replace(batch, request_counts=RequestCounts(LINES, ended // 2, ended - ended // 2))
    if kind == "finalize":
        return replace(batch, status="finalizing", finalizing_at=200)
    if kind == "finish":
        status = ending(batch, min(n, LINES), LINES)
        return replace(batch, status=status, **{f"{status}_at": 300})
    assert kind == "fail"
    return replace(batch, status="failed", failed_at=300)


writes = st.lists(st.tuples(st.sampled_from(["cancel", "publish", "progress", "finalize", "finish", "fail"]),
                            st.integers(0, 12), st.integers(0, 4)), max_size=25)


@settings(max_examples=500, deadline=None)
@given(writes=writes)
def test_any_interleaving_keeps_a_cancel_and_never_leaves_a_terminal_state(
        writes: list[tuple[str, int, int]]) -> None:
    topic: list[BatchObject] = [BATCH]
    views = [merge(None, BATCH)]  # what a reader knows after each record
    for kind, n, stale in writes:
        read = views[max(0, len(views) - 1 - stale)]  # the writer's last read, ``stale`` records ago
        written = merge(read, change(read, kind, n))
        topic.append(written)
        views.append(merge(views[-1], written))
    for before, after in pairwise(views):
        if before.terminal:
            assert after == before  # never left
        if before.cancelling_at is not None:
            assert after.cancelling_at == before.cancelling_at  # never lost
            if after.terminal:
                assert after.status in ("cancelled", "failed"), (before, after)
        assert stage(after.status) >= stage(before.status)
        assert after.request_counts.completed + after.request_counts.failed >= \
            before.request_counts.completed + before.request_counts.failed
    # Every reader that reads the same records in the same order knows the same state.
    folded = None
    for record in topic:
        folded = merge(folded, record)
    assert folded == views[-1]


def test_a_progress_write_computed_before_the_cancel_keeps_it() -> None:
    """The race that lost cancels: the runner read ``in_progress``, a gateway wrote the cancel, then the
    runner's progress and its end landed, each written from the state it had read before the cancel."""
    running = merge(BATCH, change(BATCH, "publish", 0))
    asked = merge(running, cancelled(running, 150))
    assert asked.status == "cancelling"
    progress = merge(running, change(running, "progress", 4))  # the runner did not see the cancel
    after = merge(asked, progress)
    assert after.status == "cancelling" and after.cancelling_at == 150 and after.request_counts.completed == 2
    done = merge(running, change(running, "finish", LINES))  # nor here: it would end completed
    end = merge(after, done)
    assert end.status == "cancelled" and end.cancelled_at == 300 and end.completed_at is None
    assert merge(end, merge(running, change(running, "progress", 5))) == end  # and it stays so
