"""`dflop schedule` as a user runs it, and the scheduler settings of a run config."""

import json

import pytest

from cli_helpers import assert_one_line_error, dflop, dflop_json
from dflop.errors import SpecError
from dflop.specs.run import SchedulerSpec, load_run_config
from dflop.specs.scheduling import Solver


def write_items(tmp_path, items):
    path = tmp_path / "items.json"
    path.write_text(json.dumps({"items": items}))
    return path


@pytest.mark.processes
def test_ids_come_back_as_given(tmp_path):
    ids = [1, 3.0, True, "1", "x", 2]
    items = write_items(tmp_path, [{"id": key, "cost": [i + 1, 6 - i]} for i, key in enumerate(ids)])
    out = dflop_json("schedule", "--items", items, "--bins", 2)
    returned = [key for group in out["bins"] for key in group]
    assert sorted(map(json.dumps, returned)) == sorted(map(json.dumps, ids))  # 1, "1" and true stay apart


@pytest.mark.processes
def test_an_item_without_an_id_is_named_by_its_position(tmp_path):
    items = write_items(tmp_path, [{"cost": 1}, {"cost": 2}, {"id": "a", "cost": 3}])
    out = dflop_json("schedule", "--items", items, "--bins", 2)
    assert sorted(map(json.dumps, (k for g in out["bins"] for k in g))) == sorted(['0', '1', '"a"'])


@pytest.mark.processes
def test_duplicate_ids_are_an_error_naming_them(tmp_path):
    items = write_items(tmp_path, [{"id": 1, "cost": 1}, {"id": "b", "cost": 1}, {"id": 1, "cost": 2},
                                   {"id": "b", "cost": 2}, {"id": "1", "cost": 3}])
    assert_one_line_error(dflop("schedule", "--items", items, "--bins", 2),
                          "items.json: duplicate item ids: 1 (items 0, 2); \"b\" (items 1, 3)")


@pytest.mark.parametrize("item,message", [
    ({"id": [1], "cost": 1}, "items[1]: field 'id': expected a string, a number or a boolean, got [1]"),
    ({"id": "z", "cost": 1e308}, "costs: the total of dimension 0 is beyond the float range"),
    ({"id": "z", "cost": -1}, "costs: item z has cost -1.0 in dimension 0"),
])
@pytest.mark.processes
def test_bad_items_are_one_line_errors(tmp_path, item, message):
    items = write_items(tmp_path, [{"id": "a", "cost": 1e308}, item] if "float range" in message
                        else [{"id": "a", "cost": 1}, item])
    assert_one_line_error(dflop("schedule", "--items", items, "--bins", 2), "items.json", message)


@pytest.mark.processes
@pytest.mark.parametrize("limit", ["inf", "nan", "0", "-1"])
def test_time_limits_must_be_finite_and_positive(tmp_path, limit):
    items = write_items(tmp_path, [{"id": i, "cost": i} for i in range(4)])
    assert_one_line_error(dflop("schedule", "--items", items, "--bins", 2, "--solver", "ilp", "--time-limit", limit,
                                timeout=60),
                          "--time-limit: must be a finite number of seconds above 0")


@pytest.mark.processes
def test_solver_names_any_case_and_one_error_for_unknown_ones(tmp_path):
    items = write_items(tmp_path, [{"id": i, "cost": i + 1} for i in range(4)])
    assert dflop_json("schedule", "--items", items, "--bins", 2, "--solver", "LPT")["solver"] == "lpt"
    assert_one_line_error(dflop("schedule", "--items", items, "--bins", 2, "--solver", "fastest"),
                          "--solver: unknown solver 'fastest' (valid: auto, ilp, greedy, lpt, kk, sequential, random)")


@pytest.mark.processes
def test_help_lists_every_solver_and_defines_every_status():
    text = " ".join(dflop("schedule", "--help").stdout.split())
    assert all(name.value in text for name in Solver)
    assert all(word in text for word in ("optimal", "feasible", "heuristic", "proven lower bound"))


@pytest.mark.processes
def test_json_is_the_only_thing_on_stdout_with_the_ilp(tmp_path):
    items = write_items(tmp_path, [{"id": i, "cost": [(7 * i) % 11 + 1, (5 * i) % 13 + 1]} for i in range(200)])
    for limit in ("0.05", "0.3"):
        out = dflop_json("schedule", "--items", items, "--bins", 16, "--solver", "ilp", "--time-limit", limit)
        assert out["status"] in ("optimal", "feasible")


@pytest.mark.parametrize("yaml_text,message", [
    ("time_limit: .inf", "scheduler.time_limit: must be a finite number, got inf"),
    ("time_limit: .nan", "scheduler.time_limit: must be a finite number, got nan"),
    ("time_limit: 0", "scheduler: time_limit: must be a finite number of seconds above 0, got 0.0"),
    ("solver: fast", "scheduler: solver: unknown solver 'fast' (valid: auto, ilp, greedy, lpt, kk, sequential, random)"),
])
def test_scheduler_settings_are_checked_when_the_config_is_read(tmp_path, yaml_text, message):
    config = tmp_path / "run.yaml"
    config.write_text("encoder: siglip-so400m\nllm: qwen2.5-7b\ncluster: {hardware: h100, nodes: 1, gpus_per_node: 8}\n"
                      f"training: {{global_batch: 64}}\nscheduler: {{{yaml_text}}}\n")
    with pytest.raises(SpecError) as error:
        load_run_config(config)
    assert str(error.value) == f"{config}: {message}"


def test_config_solver_names_are_case_insensitive():
    assert SchedulerSpec(solver="ILP").solver == "ilp"
