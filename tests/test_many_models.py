"""Several models loaded in one engine under one memory budget (engine/residents.py,
engine/sharing.py): no load when requests alternate, the same tokens alone or beside
others and before and after a pool shrank or grew, the least recently used unpinned
model unloaded only when shrinking is not enough, a load that cannot fit refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from exactness import prompt_tokens, vocab_size
from llm_mlx_streaming.engine.footprint import Footprint, checkpoint_layout, model_footprint
from llm_mlx_streaming.engine.kv import FULL_PRECISION
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.provider import LoadError
from llm_mlx_streaming.engine.request import LoadSpec, Request
from llm_mlx_streaming.engine.residents import Limits
from llm_mlx_streaming.engine.sharing import Claim, least_bytes, pool_bytes, split

CONTEXT, RESERVE = 512, 1000


@pytest.fixture(scope="module")
def paths(build):
    return [build("qwen3_moe", seed=seed) for seed in (11, 12, 13)]


def spec(path, slots=8) -> LoadSpec:
    footprint = model_footprint(checkpoint_layout(path), CONTEXT, FULL_PRECISION, RESERVE)
    return LoadSpec(path=path, expert_slots=slots, footprint=footprint)


def limits(max_models: int, budget=None, pinned=()) -> Limits:
    return Limits(max_models, frozenset(p.resolve() for p in pinned), budget)


def tokens(engine, load, n=8) -> list[int]:
    prompt = prompt_tokens(vocab_size(load.path), n=24, seed=5)
    return [r.token for r in engine.run(load, Request(prompt=prompt, max_tokens=n))]


def fixed(path) -> int:
    f = spec(path).footprint
    return f.fixed_bytes + pool_bytes(f, [8] * len(f.expert_bytes))


@pytest.fixture(scope="module")
def alone(paths):
    """Each model's tokens in an engine of its own."""
    out = []
    for path in paths:
        engine = EngineManager()
        out.append(tokens(engine, spec(path)))
        engine.unload()
    return out


def slots_of(engine, path):
    return next(m.expert_slots for m in engine.residency().models if m.path == path.resolve())


def loaded(engine) -> set:
    return {m.path for m in engine.residency().models}


# -- the split ----------------------------------------------------------------------------


def test_the_split_is_max_min_fair_above_every_floor_and_none_below_them():
    f = Footprint(fixed_bytes=100, reserve_bytes=50, expert_bytes=(10, 10), num_experts=8, floor=2)
    small, big = Claim(f, (3, 3)), Claim(f, (8, 8))
    least = least_bytes([small, big])
    assert least == 2 * 100 + 50 + 2 * 40
    assert split(least - 1, [small, big]) is None
    assert split(least, [small, big]) == [(2, 2), (2, 2)]
    assert split(least + 80, [small, big]) == [(3, 3), (5, 5)]  # small takes its 20, big the other 60
    assert split(10**6, [small, big]) == [(3, 3), (8, 8)]  # never beyond what was asked for


# -- the engine -----------------------------------------------------------------------------


def test_alternating_requests_load_each_model_once_and_answer_as_alone(paths, alone):
    engine = EngineManager()
    engine.limit(limits(2))
    a, b = spec(paths[0]), spec(paths[1])
    got = [tokens(engine, load) for load in (a, b, a, b, a)]
    assert engine.residency().loads == 2
    assert got == [alone[0], alone[1], alone[0], alone[1], alone[0]]
    assert {p.name for p in loaded(engine)} == {paths[0].name, paths[1].name}
    engine.unload()
    assert not loaded(engine) and engine.state == "empty"


def test_a_third_model_shrinks_the_others_then_they_grow_back_with_the_same_tokens(paths, alone):
    engine = EngineManager()
    budget = fixed(paths[0]) + fixed(paths[1]) + spec(paths[2]).footprint.fixed_bytes + RESERVE + 4 * 64
    engine.limit(limits(3, budget))
    loads = [spec(p) for p in paths]
    tokens(engine, loads[0]), tokens(engine, loads[1])
    assert slots_of(engine, paths[0]) == slots_of(engine, paths[1]) == 8  # both fit as asked
    assert tokens(engine, loads[2]) == alone[2]
    assert engine.residency().loads == 3  # nothing unloaded: the pools made room
    shrunk = [slots_of(engine, p) for p in paths]
    assert all(isinstance(s, list) and min(s) >= 2 and max(s) < 8 for s in shrunk)
    assert [tokens(engine, load) for load in loads] == alone  # smaller pools, same tokens
    list(engine.queue_unload(paths[2]))
    assert slots_of(engine, paths[0]) == slots_of(engine, paths[1]) == 8  # grown back
    assert [tokens(engine, load) for load in loads[:2]] == alone[:2]
    assert engine.residency().loads == 3
    engine.unload()


def test_when_floors_do_not_fit_the_least_recently_used_unpinned_model_goes(paths, alone):
    engine = EngineManager()
    floors = [least_bytes([Claim(spec(p).footprint, (2, 2))]) - RESERVE for p in paths]
    budget = floors[0] + floors[1] + RESERVE + 64  # two models at their floors, never three
    engine.limit(limits(3, budget, pinned=paths[:1]))
    loads = [spec(p) for p in paths]
    tokens(engine, loads[0]), tokens(engine, loads[1]), tokens(engine, loads[0])
    assert tokens(engine, loads[2]) == alone[2]
    assert loaded(engine) == {paths[0].resolve(), paths[2].resolve()}  # b was used last-but-one
    assert tokens(engine, loads[1]) == alone[1]  # the pinned a stays, c goes
    assert loaded(engine) == {paths[0].resolve(), paths[1].resolve()}
    engine.unload()


def test_a_load_that_cannot_fit_beside_pinned_models_is_one_line_naming_what_is_loaded(paths):
    engine = EngineManager()
    budget = least_bytes([Claim(spec(paths[0]).footprint, (2, 2))]) + 64
    engine.limit(limits(3, budget, pinned=paths[:1]))
    tokens(engine, spec(paths[0]))
    with pytest.raises(LoadError) as refused:
        tokens(engine, spec(paths[1]))
    message = str(refused.value)
    assert "\n" not in message and paths[1].name in message and paths[0].name in message
    assert "needs at least" in message and "pinned" in message
    assert loaded(engine) == {paths[0].resolve()}  # the pinned one untouched
    engine.unload()


def test_max_models_unloads_the_least_recently_used(paths, alone):
    engine = EngineManager()  # max_models 1: a request for another model unloads the first
    assert [tokens(engine, spec(p)) for p in paths[:2]] == alone[:2]
    assert loaded(engine) == {paths[1].resolve()}
    engine.unload()


def test_asking_for_other_slots_rebuilds_only_that_model(paths, alone):
    engine = EngineManager()
    engine.limit(limits(2))
    a, b = spec(paths[0]), spec(paths[1])
    tokens(engine, a), tokens(engine, b)
    assert tokens(engine, replace(a, expert_slots=3)) == alone[0]
    assert slots_of(engine, paths[0]) == 3 and slots_of(engine, paths[1]) == 8
    assert engine.residency().loads == 2
    engine.unload()


def test_pinned_pools_shrink_only_once_the_unpinned_ones_are_at_their_floor():
    f = Footprint(fixed_bytes=100, reserve_bytes=50, expert_bytes=(10, 10), num_experts=8, floor=2)
    pinned, other = Claim(f, (8, 8), pinned=True), Claim(f, (8, 8))
    least = least_bytes([pinned, other])
    assert split(least + 120, [other, pinned]) == [(2, 2), (8, 8)]  # the pinned pool whole, the other at its floor
    assert split(least + 100, [other, pinned]) == [(2, 2), (7, 7)]  # then the pinned one gives up slots
    assert split(least + 160, [other, pinned]) == [(4, 4), (8, 8)]
    assert split(least + 160, [Claim(f, (8, 8), pinned=True), pinned]) == [(6, 6), (6, 6)]  # fair among pinned


def test_a_third_model_shrinks_the_unpinned_pools_and_leaves_the_pinned_one_whole(paths, alone):
    engine = EngineManager()
    budget = fixed(paths[0]) + fixed(paths[1]) + spec(paths[2]).footprint.fixed_bytes + RESERVE + 4 * 64
    engine.limit(limits(3, budget, pinned=paths[:1]))
    loads = [spec(p) for p in paths]
    assert [tokens(engine, load) for load in loads] == alone
    assert slots_of(engine, paths[0]) == 8
    assert all(isinstance(s, list) and max(s) < 8 for s in (slots_of(engine, p) for p in paths[1:]))
    engine.unload()


def test_a_switch_turns_to_the_same_model_object_and_moves_nothing(paths, alone):
    engine = EngineManager()
    engine.limit(limits(2))
    a, b = spec(paths[0]), spec(paths[1])
    tokens(engine, a)
    first, prompts = engine.running, engine.prompts
    first.noted = "anything a model holds stays with it"
    assert tokens(engine, b) == alone[1] and engine.running is not first
    assert tokens(engine, a) == alone[0]
    assert engine.running is first and engine.prompts is prompts and first.noted
    assert [m.running for m in engine.residency().models] == [True, False]
    engine.unload()


def test_limits_set_again_unpin_a_model_so_that_another_takes_its_place(paths, alone):
    engine = EngineManager()
    engine.limit(limits(1, pinned=paths[:1]))
    tokens(engine, spec(paths[0]))
    with pytest.raises(LoadError) as refused:
        tokens(engine, spec(paths[1]))
    assert "max_models 1 are loaded and pinned" in str(refused.value)
    engine.limit(Limits())  # what a server that stopped leaves to the process
    assert tokens(engine, spec(paths[1])) == alone[1]
    assert loaded(engine) == {paths[1].resolve()}
    engine.unload()
