"""Every data-efficiency schedule equals DeepSpeed's value at every step of a 10k-step sweep: the
curriculum schedules (fixed_linear, fixed_root, fixed_discrete, custom) and random-LTD's against
DeepSpeed 0.19.8, the legacy seqlen curriculum and PLD theta (the values the forward receives) against
0.19.6. The DeepSpeed values are pinned in tests/fixtures/data_efficiency/schedules.npz by
make_fixtures.py, which ran DeepSpeed's own schedulers."""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from deepspeed_c.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler
from deepspeed_c.runtime.progressive_layer_drop import ProgressiveLayerDrop
from tests.fixtures.data_efficiency.cases import CURRICULUM, PLD, RANDOM_LTD, STEPS, custom_schedule

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "data_efficiency", "schedules.npz")


@pytest.fixture(scope="module")
def pinned() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


def _sched(name: str, **kw) -> CurriculumScheduler:
    s = CurriculumScheduler(copy.deepcopy(CURRICULUM[name]), **kw)
    if CURRICULUM[name]["schedule_type"] == "custom":
        s.set_custom_get_difficulty(custom_schedule)
    return s


def _first_diff(ours: list, ref: np.ndarray) -> str:
    bad = [i for i in range(len(ref)) if ours[i] != ref[i]]
    return f"{len(bad)} steps differ, first at step {bad[0]}: ours {ours[bad[0]]} vs DeepSpeed {ref[bad[0]]}" if bad \
        else ""


@pytest.mark.parametrize("name", sorted(CURRICULUM))
def test_library_curriculum_equals_deepspeed_0198(pinned, name):
    s = _sched(name)
    got = [s.get_difficulty(g) for g in range(STEPS)]
    assert not _first_diff(got, pinned[f"lib/{name}/get"]), _first_diff(got, pinned[f"lib/{name}/get"])
    s = _sched(name)
    upd = [s.update_difficulty(g) for g in range(STEPS)]
    assert not _first_diff(upd, pinned[f"lib/{name}/update"]), _first_diff(upd, pinned[f"lib/{name}/update"])


@pytest.mark.parametrize("name", sorted(CURRICULUM))
def test_legacy_curriculum_equals_deepspeed_0196(pinned, name):
    s = _sched(name, raise_to_min_difficulty=False)
    seen = []
    for global_steps in range(STEPS):
        s.update_difficulty(global_steps + 1)
        seen.append(s.get_current_difficulty())
    assert not _first_diff(seen, pinned[f"legacy/{name}"]), _first_diff(seen, pinned[f"legacy/{name}"])


def test_the_two_releases_differ_where_the_floor_falls_below_min(pinned):
    """0.19.8 raises a floored ramp value below min_difficulty; 0.19.6 did not: the fixture shows both."""
    assert pinned["lib/linear_min_off_step/get"][0] == 16
    assert pinned["legacy/linear_min_off_step"][0] == 0


@pytest.mark.parametrize("name", sorted(RANDOM_LTD))
def test_random_ltd_schedule_equals_deepspeed_0198(pinned, name):
    s = RandomLTDScheduler(copy.deepcopy(RANDOM_LTD[name]))
    seq, tokens = [], []
    for g in range(STEPS):
        s.update_seq(g)
        seq.append(s.get_current_seq())
        tokens.append(s.state["consumed_layer_tokens"])
    assert not _first_diff(seq, pinned[f"ltd/{name}/seq"]), _first_diff(seq, pinned[f"ltd/{name}/seq"])
    assert not _first_diff(tokens, pinned[f"ltd/{name}/tokens"]), _first_diff(tokens, pinned[f"ltd/{name}/tokens"])
    again = RandomLTDScheduler(copy.deepcopy(RANDOM_LTD[name]))
    assert again.get_total_layer_tokens(STEPS) == tokens[-1]


@pytest.mark.parametrize("name", sorted(PLD))
def test_pld_theta_equals_deepspeed_0196_bitwise(pinned, name):
    theta, gamma = PLD[name]
    pld = ProgressiveLayerDrop(theta=theta, gamma=gamma)
    seen = []
    for global_steps in range(STEPS):
        state = pld.get_state()
        assert state["progressive_layer_drop"] is True
        seen.append(state["pld_theta"])
        pld.update_state(global_steps)
    np.testing.assert_array_equal(np.array(seen, dtype=np.float64), pinned[f"pld/{name}"])


def test_scheduler_state_round_trips():
    a = _sched("root2")
    for g in range(1234):
        a.update_difficulty(g)
    b = _sched("root2")
    b.load_state_dict(a.state_dict())
    assert [a.update_difficulty(g) for g in range(1234, 3000)] == [b.update_difficulty(g) for g in range(1234, 3000)]
    r = RandomLTDScheduler(copy.deepcopy(RANDOM_LTD["odd"]))
    for g in range(500):
        r.update_seq(g)
    r2 = RandomLTDScheduler(copy.deepcopy(RANDOM_LTD["odd"]))
    r2.load_state_dict(r.state_dict())
    assert r2.state_dict() == r.state_dict()


def _cfg(**over):
    cfg = copy.deepcopy(CURRICULUM["linear_gpt"])
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("cfg, key", [
    (_cfg(schedule_type="fixed_cubic"), "curriculum_learning.schedule_type"),
    (_cfg(min_difficulty=2048), "curriculum_learning.min_difficulty"),
    ({"max_difficulty": 8, "schedule_type": "fixed_linear"}, "curriculum_learning.min_difficulty"),
    (_cfg(schedule_config={"difficulty_step": 8}), "curriculum_learning.schedule_config.total_curriculum_step"),
    (_cfg(schedule_type="fixed_root"), "curriculum_learning.schedule_config.root_degree"),
    (_cfg(schedule_type="fixed_discrete", schedule_config={"difficulty": [1, 2], "max_step": [1, 2]}),
     "curriculum_learning.schedule_config.difficulty"),
    (_cfg(schedule_config={"total_curriculum_step": 0, "difficulty_step": 8}),
     "curriculum_learning.schedule_config.total_curriculum_step"),
])
def test_bad_curriculum_config_names_the_key(cfg, key):
    with pytest.raises(DeepSpeedConfigError, match=key.replace(".", r"\.")):
        CurriculumScheduler(cfg)


def test_custom_schedule_without_function_says_what_to_call():
    s = CurriculumScheduler(copy.deepcopy(CURRICULUM["custom"]))
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        s.update_difficulty(1)


@pytest.mark.parametrize("path, value, key", [
    (("random_ltd_schedule", "schedule_type"), "fixed_root", "random_ltd_schedule.schedule_type"),
    (("random_ltd_schedule", "min_value"), 4096, "random_ltd_schedule.min_value"),
    (("random_ltd_layer_num",), 99, "random_ltd_layer_num"),
])
def test_bad_random_ltd_config_names_the_key(path, value, key):
    cfg = copy.deepcopy(RANDOM_LTD["gpt_2048"])
    node = cfg
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    with pytest.raises(DeepSpeedConfigError, match=key.replace(".", r"\.")):
        RandomLTDScheduler(cfg)
