"""The one input-reading path (dflop.specs.loading): bytes, nesting, duplicate keys and numbers."""

import dataclasses
import math

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from dflop.errors import SpecError
from dflop.specs import ClusterSpec, HardwareSpec, Plan, TrainingSpec, from_mapping, presets, to_mapping
from dflop.specs.limits import MAX_DEPTH, MAX_GLOBAL_BATCH, MAX_INT, MAX_SAMPLES
from dflop.specs.loading import load_json, load_yaml, parse_json, parse_yaml
from dflop.specs.resolve import named_spec
from dflop.specs.run import DataSpec, RunConfig, SchedulerSpec, load_run_config


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path):
    for name, load in (("c.yaml", load_yaml), ("c.json", load_json)):
        path = tmp_path / name
        path.write_bytes(b'{"a": 1,\n "b":\n "\xff\xfe"}\n')
        with pytest.raises(SpecError, match=rf"^{path}:3: not UTF-8 text \(byte 0xff\)$"):
            load(path)


def test_a_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "c.json"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}')
    assert load_json(path) == {"a": 1}


def test_a_folder_or_a_missing_file_is_named(tmp_path):
    with pytest.raises(SpecError, match=rf"^{tmp_path}: is a folder, expected a file$"):
        load_yaml(tmp_path)
    with pytest.raises(SpecError, match="nope.yaml: file not found"):
        load_yaml(tmp_path / "nope.yaml")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000, 100_000])
def test_json_nested_beyond_the_bound_is_refused_not_a_recursion_error(depth):
    for text in ("[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth):
        with pytest.raises(SpecError, match=rf"x.json: not valid JSON \(nested deeper than {MAX_DEPTH} levels\)"):
            parse_json(text, "x.json")
    with pytest.raises(SpecError, match=r"x.json(:1)?: not valid JSON"):  # unbalanced: either message
        parse_json("[" * depth, "x.json")


def test_json_at_the_bound_and_brackets_inside_strings_are_fine():
    assert parse_json("[" * MAX_DEPTH + "]" * MAX_DEPTH, "x") == eval("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    assert parse_json('{"s": "' + "[" * 5000 + '\\"' + '"}', "x") == {"s": "[" * 5000 + '"'}


def test_json_integers_of_too_many_digits_are_refused():
    with pytest.raises(SpecError, match="x.json: not valid JSON .*digits"):
        parse_json("1" * 5000, "x.json")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000])
def test_yaml_nested_beyond_the_bound_is_refused(depth):
    for text in ("[" * depth + "]" * depth, "a:\n" + "".join("  " * i + "- \n" for i in range(1, depth))):
        with pytest.raises(SpecError, match=rf"c.yaml:\d+: not valid YAML \(nested deeper than {MAX_DEPTH}"):
            parse_yaml(text, "c.yaml")


def test_duplicate_yaml_keys_are_refused_naming_key_and_lines():
    with pytest.raises(SpecError, match=r"^c.yaml:4: not valid YAML \(duplicate key 'llm' \(first given on line 2\)\)$"):
        parse_yaml("encoder: a\nllm: b\ncluster: c\nllm: d\n", "c.yaml")
    with pytest.raises(SpecError, match=r"c.yaml:1: .*duplicate key 'x'"):
        parse_yaml("{x: 1, y: 2, x: 3}", "c.yaml")
    with pytest.raises(SpecError, match=r"c.yaml:3: .*duplicate key 'tp'"):
        parse_yaml("llm:\n  tp: 1\n  tp: 2\n", "c.yaml")


def test_merge_keys_may_override_what_they_merge():
    assert parse_yaml("base: &b {tp: 1, pp: 2}\nllm:\n  <<: *b\n  tp: 4\n", "c")["llm"] == {"tp": 4, "pp": 2}


def test_yaml_integers_of_too_many_digits_are_refused():
    with pytest.raises(SpecError, match="c.yaml: not valid YAML"):
        parse_yaml("a: " + "1" * 5000, "c.yaml")


def _number_fields(cls):
    return [(f.name, f.type) for f in dataclasses.fields(cls) if f.type in ("float", "int")]


SPECS = {
    HardwareSpec: to_mapping(presets.hardware("h100")),
    ClusterSpec: {"hardware": "h100", "nodes": 1, "gpus_per_node": 8},
    TrainingSpec: {"global_batch": 64},
    Plan: {"encoder": {}, "llm": {}, "microbatches": 1},
    DataSpec: {},
    SchedulerSpec: {},
    RunConfig: to_mapping(load_run_config()),
}
BAD = {"float": [math.inf, -math.inf, math.nan, "inf", "nan", "-1e999", 1e31, -1e300],
       "int": [MAX_INT + 1, -(10**30), 10**400, math.inf, math.nan]}


@pytest.mark.parametrize("cls", list(SPECS), ids=lambda c: c.__name__)
@given(data=st.data())
def test_every_number_of_a_spec_must_be_finite_and_sane(cls, data):
    field, kind = data.draw(st.sampled_from(_number_fields(cls)))
    bad = data.draw(st.sampled_from(BAD[kind]))
    with pytest.raises(SpecError, match=rf"^c.yaml: {field}: (must be (a finite number|at (most|least))"
                                        r"|expected an integer)"):
        from_mapping(cls, {**SPECS[cls], field: bad}, "c.yaml:", named_spec)


def test_direct_construction_is_checked_too():
    h100 = presets.hardware("h100")
    with pytest.raises(SpecError, match="^peak_flops: must be a finite number, got inf$"):
        dataclasses.replace(h100, peak_flops=math.inf)
    with pytest.raises(SpecError, match="^efficiency: must be a finite number, got nan$"):
        dataclasses.replace(h100, efficiency=((1e9, math.nan),))
    with pytest.raises(SpecError, match="^time_limit: must be a finite number, got inf$"):
        SchedulerSpec(time_limit=math.inf)


def test_sizes_that_cannot_be_allocated_and_negative_seeds_are_refused():
    with pytest.raises(SpecError, match=rf"c: global_batch: must be at most {MAX_GLOBAL_BATCH}, got 10000000000"):
        from_mapping(TrainingSpec, {"global_batch": 10**10}, "c:")
    with pytest.raises(SpecError, match=rf"c: samples: must be at most {MAX_SAMPLES}"):
        from_mapping(DataSpec, {"samples": 10**9}, "c:")
    with pytest.raises(SpecError, match="c: seed: must be at least 0, got -1"):
        from_mapping(DataSpec, {"seed": -1}, "c:")
    config = to_mapping(load_run_config())
    with pytest.raises(SpecError, match="c: seed: must be at least 0, got -5"):
        from_mapping(RunConfig, {**config, "seed": -5}, "c:", named_spec)


def test_config_time_limit_inf_and_peak_flops_inf_name_file_and_key(tmp_path):
    path = tmp_path / "run.yaml"
    hardware = {**SPECS[HardwareSpec], "peak_flops": "PEAK"}
    config = {"encoder": "siglip-so400m", "llm": "qwen2.5-7b", "training": {"global_batch": 8},
              "cluster": {"hardware": hardware, "nodes": 1, "gpus_per_node": 8}}
    path.write_text(yaml.safe_dump(config).replace("PEAK", ".inf"))
    with pytest.raises(SpecError, match=rf"^{path}: cluster.hardware.peak_flops: must be a finite number, got inf$"):
        load_run_config(path)
    path.write_text("encoder: siglip-so400m\nllm: qwen2.5-7b\ntraining: {global_batch: 8}\n"
                    "cluster: {hardware: h100, nodes: 1, gpus_per_node: 8}\nscheduler: {time_limit: .inf}\n")
    with pytest.raises(SpecError, match=rf"^{path}: scheduler.time_limit: must be a finite number, got inf$"):
        load_run_config(path)
