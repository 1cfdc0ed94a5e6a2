"""A feed's lifecycle: every transition from every state, the paths a worker takes, and any walk at all."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.batcher.residency import Tier
from kinfer.consumers.feed import TRANSITIONS, FeedLifecycle, FeedState, IllegalTransition

ON_DEVICE = {FeedState.WARM, FeedState.JOINING, FeedState.SERVING, FeedState.DRAINING, FeedState.LEAVING}


def paths() -> dict[FeedState, list[str]]:
    """The shortest transitions from a new feed (on disk) to each state it can reach."""
    found = {FeedState.DISK: list[str]()}
    queue = deque([FeedState.DISK])
    while queue:
        state = queue.popleft()
        for name, (sources, target) in TRANSITIONS.items():
            if state in sources and target not in found:
                found[target] = [*found[state], name]
                queue.append(target)
    return found


def reach(state: FeedState, via: list[str] | None = None) -> FeedLifecycle:
    life = FeedLifecycle()
    for name in paths()[state] if via is None else via:
        getattr(life, name)()
    assert life.state is state
    return life


def test_every_state_is_reachable_from_disk_and_leads_back_to_it() -> None:
    assert set(paths()) == set(FeedState)
    for state in FeedState:  # no dead end: a model can always end on disk again
        seen, queue = {state}, deque([state])
        while queue:
            here = queue.popleft()
            for sources, target in TRANSITIONS.values():
                if here in sources and target not in seen:
                    seen.add(target)
                    queue.append(target)
        assert FeedState.DISK in seen, state


def test_every_transition_in_the_table_is_a_method() -> None:
    for name in TRANSITIONS:
        assert callable(getattr(FeedLifecycle(), name))


@pytest.mark.parametrize("state", list(FeedState), ids=lambda s: s.name)
@pytest.mark.parametrize("transition", list(TRANSITIONS))
def test_each_transition_from_each_state_moves_as_the_table_says_or_is_refused(
        state: FeedState, transition: str) -> None:
    life = reach(state)
    sources, target = TRANSITIONS[transition]
    if state in sources:
        getattr(life, transition)()
        assert life.state is target
    else:
        with pytest.raises(IllegalTransition) as refused:
            getattr(life, transition)()
        assert life.state is state  # a refused move changes nothing
        assert refused.value.transition == transition and refused.value.state is state
        assert transition in str(refused.value) and state.name in str(refused.value)


def test_the_legal_moves_are_exactly_these() -> None:
    legal = {(s, name) for name, (sources, _) in TRANSITIONS.items() for s in sources}
    assert legal == {
        (FeedState.DISK, "load"), (FeedState.HOST, "load"),
        (FeedState.LOADING, "warm"), (FeedState.LOADING, "join"), (FeedState.WARM, "join"),
        (FeedState.JOINING, "joined"),
        (FeedState.SERVING, "drain"), (FeedState.DRAINING, "undrain"),
        (FeedState.SERVING, "leave"), (FeedState.DRAINING, "leave"), (FeedState.LEAVING, "left"),
        (FeedState.WARM, "offload"), (FeedState.WARM, "unload"), (FeedState.HOST, "unload"),
        *((s, "fail") for s in FeedState),
    }


@pytest.mark.parametrize("state", list(FeedState), ids=lambda s: s.name)
def test_what_each_state_says(state: FeedState) -> None:
    life = reach(state)
    expected_tier = {FeedState.DISK: Tier.DISK, FeedState.HOST: Tier.HOST, FeedState.LOADING: Tier.DISK}
    assert life.tier == expected_tier.get(state, Tier.DEVICE)
    assert (life.tier == Tier.DEVICE) == (state in ON_DEVICE)
    assert life.shown == ("loading" if state in (FeedState.LOADING, FeedState.JOINING) else life.tier.name.lower())
    assert life.draining == (state in (FeedState.DRAINING, FeedState.LEAVING))
    assert life.leaving == (state is FeedState.LEAVING)


@pytest.mark.parametrize("source", [Tier.DISK, Tier.HOST])
def test_loading_weights_are_where_they_came_from_until_they_are_in(source: Tier) -> None:
    life = reach(FeedState.DISK if source == Tier.DISK else FeedState.HOST)
    life.load()
    assert life.tier == source and life.shown == "loading"
    life.join()
    assert life.tier == Tier.DEVICE and life.shown == "loading"  # until its first partitions came
    life.joined()
    assert life.tier == Tier.DEVICE and life.shown == "device"


@pytest.mark.parametrize(("path", "end"), [
    (["load", "warm", "join", "joined"], FeedState.SERVING),  # start-up, resident: joins once all are loaded
    (["load", "warm", "offload"], FeedState.HOST),  # start-up, in host RAM: read and warmed up once
    (["load", "warm"], FeedState.WARM),  # a swap-in as the worker stops: no join
    (["load", "join", "joined", "drain", "undrain", "drain", "leave", "left", "offload", "load", "join", "joined",
      "leave", "left", "unload"], FeedState.DISK),  # swapped in and out
    (["load", "warm", "offload", "unload"], FeedState.DISK),  # host RAM to disk
])
def test_the_paths_a_worker_takes(path: list[str], end: FeedState) -> None:
    reach(end, via=path)


@pytest.mark.parametrize("state", list(FeedState), ids=lambda s: s.name)
def test_a_failed_swap_puts_the_model_back_on_disk_from_anywhere_and_it_can_load_again(state: FeedState) -> None:
    life = reach(state)
    life.fail()
    assert life.state is FeedState.DISK and life.tier == Tier.DISK and not life.draining
    life.load()
    assert life.tier == Tier.DISK  # loading from disk, whatever the source before the failure


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.sampled_from(sorted(TRANSITIONS)), max_size=40))
def test_any_walk_moves_by_the_table_and_keeps_the_invariants(walk: list[str]) -> None:
    life = FeedLifecycle()
    for name in walk:
        before, tier_before = life.state, life.tier
        sources, target = TRANSITIONS[name]
        try:
            getattr(life, name)()
        except IllegalTransition:
            assert before not in sources and life.state is before
            continue
        assert before in sources and life.state is target
        if target is FeedState.LOADING:
            assert life.tier == tier_before  # weights not moved yet
        assert (life.tier == Tier.DEVICE) == (life.state in ON_DEVICE)
        assert not life.leaving or life.draining
