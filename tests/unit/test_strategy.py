"""Tests for graphpar.strategy.Strategy: validation messages, normalisation, serialisation."""

import dataclasses
import json
import os.path
from types import SimpleNamespace

import pytest
import torch

from graphpar.strategy import Strategy


def module_level_pass(graph):
    return graph


def _error(**kwargs) -> str:
    with pytest.raises(ValueError) as info:
        Strategy(**kwargs)
    return str(info.value)


def _assert_names(msg: str, *parts: str) -> None:
    for part in parts:
        assert part in msg, f"{part!r} missing from: {msg}"


# --------------------------------------------------------------------------- #
# Defaults and the public contract
# --------------------------------------------------------------------------- #


def test_defaults_are_the_public_contract():
    defaults = {f.name: f.default for f in dataclasses.fields(Strategy)}
    assert defaults == {
        "dp": 1, "tp": 1, "pp": 1, "microbatches": 1, "schedule": "1f1b", "virtual_stages": 1,
        "partition": "parameters", "sequence_parallel": False, "offload_optimizer": False,
        "offload_embedding": False, "param_dtype": None, "reduce_dtype": None, "zero": 0, "recompute": None,
        "ep": 1, "seed": 0, "passes": (), "strict": False, "expert_tp": 1, "expert_capacity_factor": None,
    }
    # the contract's fields first, in its order (a positional Strategy(...) keeps its meaning)
    assert [f.name for f in dataclasses.fields(Strategy)][:18] == [
        "dp", "tp", "pp", "microbatches", "schedule", "virtual_stages", "partition", "sequence_parallel",
        "offload_optimizer", "offload_embedding", "param_dtype", "reduce_dtype", "zero", "recompute", "ep", "seed",
        "passes", "strict"]


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Strategy().dp = 2


def test_world_size_property():
    assert Strategy(dp=2, tp=4, pp=3).world_size == 24


def test_lists_are_normalised_to_tuples():
    s = Strategy(pp=2, partition=["layers.6"], offload_embedding=["embed"], passes=["a.b:c"])
    assert s.partition == ("layers.6",)
    assert s.offload_embedding == ("embed",)
    assert s.passes == ("a.b:c",)
    assert s == Strategy(pp=2, partition=("layers.6",), offload_embedding=("embed",), passes=("a.b:c",))


@pytest.mark.parametrize(
    "text, dtype",
    [("float32", torch.float32), ("fp32", torch.float32), ("bfloat16", torch.bfloat16),
     ("bf16", torch.bfloat16), ("float16", torch.float16), ("fp16", torch.float16)],
)
def test_param_dtype_strings_are_normalised(text, dtype):
    assert Strategy(param_dtype=text).param_dtype is dtype


# --------------------------------------------------------------------------- #
# Single-field rules
# --------------------------------------------------------------------------- #


def test_tp_zero_matches_documented_message():
    assert _error(tp=0) == (
        "Strategy.tp=0 is invalid: tensor-parallel degree must be a positive int. "
        "Fix: use tp=1 to disable tensor parallelism."
    )


@pytest.mark.parametrize("field", ["dp", "tp", "pp", "microbatches", "virtual_stages"])
def test_degrees_must_be_positive(field):
    msg = _error(**{field: -2})
    _assert_names(msg, f"Strategy.{field}=-2", "positive int", "Fix:", f"{field}=1")


@pytest.mark.parametrize(
    "value, type_name, fix",
    [(2.0, "float", "dp=2"), ("4", "str", "dp=4"), (True, "bool", "dp=1"), (1.5, "float", "dp=1")],
)
def test_degrees_must_be_ints_and_name_the_type(value, type_name, fix):
    msg = _error(dp=value)
    _assert_names(msg, f"Strategy.dp={value!r}", f"got {type_name}", "Fix:", fix)


def test_numpy_ints_are_accepted_and_become_python_ints():
    np = pytest.importorskip("numpy")
    s = Strategy(dp=np.int64(2))
    assert type(s.dp) is int
    json.dumps(s.to_dict())


@pytest.mark.parametrize("value, suggestion", [("1F1B", "'1f1b'"), ("gpipe ", "'gpipe'"), ("interleaved", "'interleaved-1f1b'")])
def test_schedule_near_miss_suggests_closest(value, suggestion):
    msg = _error(schedule=value)
    _assert_names(msg, f"Strategy.schedule={value!r}", "must be one of", f"Fix: use schedule={suggestion}")


def test_schedule_unknown_lists_allowed_values():
    msg = _error(schedule="zigzag")
    _assert_names(msg, "schedule='zigzag'", "Fix:", "'gpipe'", "'1f1b'", "'interleaved-1f1b'")


def test_schedule_wrong_type():
    _assert_names(_error(schedule=1), "schedule=1", "got int", "Fix:")


@pytest.mark.parametrize("field", ["sequence_parallel", "offload_optimizer", "strict"])
def test_bool_fields_reject_non_bools(field):
    msg = _error(**{field: 1})
    _assert_names(msg, f"Strategy.{field}=1", "must be a bool", "got int", f"Fix: use {field}=True")


def test_seed_must_be_non_negative():
    _assert_names(_error(seed=-3), "Strategy.seed=-3", "non-negative int", "Fix:", "seed=0")


def test_seed_must_be_int():
    _assert_names(_error(seed=1.0), "Strategy.seed=1.0", "got float", "Fix: use seed=1")


def test_param_dtype_rejects_other_dtypes():
    msg = _error(param_dtype=torch.float64)
    _assert_names(msg, "Strategy.param_dtype=torch.float64", "torch.bfloat16", "Fix:")


def test_param_dtype_near_miss_string():
    _assert_names(_error(param_dtype="bfloat"), "param_dtype='bfloat'", "Fix: use param_dtype='bfloat16'")


@pytest.mark.parametrize("param_dtype, reduce_dtype, gradient_dtype", [
    (None, None, torch.float32), ("bf16", None, torch.float32),     # fp32 gradients by default
    ("bf16", "fp32", torch.float32), ("bf16", "bf16", torch.bfloat16), ("fp16", "float16", torch.float16),
    (None, "float32", torch.float32), ("fp32", "fp32", torch.float32),
])
def test_reduce_dtype_is_fp32_or_the_compute_dtype(param_dtype, reduce_dtype, gradient_dtype):
    s = Strategy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    assert s.gradient_dtype is gradient_dtype
    assert s.reduce_dtype is (None if reduce_dtype is None else gradient_dtype)  # strings normalised


@pytest.mark.parametrize("kwargs, names", [
    (dict(reduce_dtype="bf16"), ("Strategy.reduce_dtype=torch.bfloat16 with param_dtype=None is invalid",
                                 "fp32 or in the compute dtype", "Fix: use reduce_dtype=None",
                                 "set param_dtype=torch.bfloat16 as well")),
    (dict(param_dtype="fp16", reduce_dtype="bf16"), ("reduce_dtype=torch.bfloat16 with param_dtype=torch.float16",
                                                     "here torch.float16", "Fix:")),
    (dict(param_dtype="bf16", reduce_dtype=torch.float64), ("Strategy.reduce_dtype=torch.float64",
                                                            "torch.float32, torch.bfloat16 or torch.float16", "Fix:")),
    (dict(param_dtype="bf16", reduce_dtype="fp23"), ("reduce_dtype='fp23'", "Fix: use reduce_dtype='fp32'")),
    (dict(param_dtype="bf16", reduce_dtype=2), ("reduce_dtype=2", "must be None", "Fix:")),
])
def test_reduce_dtype_refusals_name_the_value_the_rule_and_a_fix(kwargs, names):
    _assert_names(_error(**kwargs), *names)


def test_partition_unknown_policy_suggests_closest():
    _assert_names(_error(partition="param"), "Strategy.partition='param'", "Fix: use partition='parameters'")


def test_partition_bare_module_path_suggests_a_list():
    _assert_names(_error(pp=2, partition="layers.3"), "partition='layers.3'", "partition=['layers.3']")


def test_partition_type_regex_must_compile():
    msg = _error(partition="type:Block(")
    _assert_names(msg, "Strategy.partition='type:Block('", "does not compile", "missing )", "Fix:")


def test_partition_type_regex_must_be_non_empty():
    _assert_names(_error(partition="type:"), "partition='type:'", "regex", "Fix:")


def test_partition_type_regex_accepted():
    assert Strategy(partition="type:Decoder.*Layer").partition == "type:Decoder.*Layer"


def test_partition_list_must_be_non_empty():
    _assert_names(_error(partition=[]), "Strategy.partition=[]", "non-empty", "Fix:", "partition='parameters'")


def test_partition_list_entries_must_be_non_empty_strings():
    _assert_names(_error(pp=3, partition=["a", ""]), "partition=['a', '']", "entry 1", "empty string", "Fix:")
    _assert_names(_error(pp=3, partition=["a", 7]), "entry 1", "7 of type int", "Fix:")


def test_partition_list_entries_must_be_unique():
    _assert_names(_error(pp=3, partition=["a", "a"]), "partition=['a', 'a']", "more than once", "Fix:")


def test_partition_wrong_type():
    _assert_names(_error(partition=3), "Strategy.partition=3", "got int", "Fix:")


def test_offload_embedding_wrong_type():
    msg = _error(offload_embedding="embed")
    _assert_names(msg, "Strategy.offload_embedding='embed'", "True, False, or a list", "Fix:", "['embed_tokens']")


def test_offload_embedding_list_entries():
    _assert_names(_error(offload_embedding=["ok", 3]), "offload_embedding=['ok', 3]", "entry 1", "Fix:")


def test_passes_must_be_a_sequence():
    _assert_names(_error(passes="a.b:c"), "Strategy.passes='a.b:c'", "tuple or list", "Fix:", "passes=('a.b:c',)")


def test_passes_string_form_is_validated():
    msg = _error(passes=["mypkg.passes.fuse"])
    _assert_names(msg, "passes[0]='mypkg.passes.fuse'", "package.module:function", "Fix: use 'mypkg.passes:fuse'")


def test_passes_reject_other_objects():
    _assert_names(_error(passes=[3]), "Strategy.passes=[3]", "passes[0]=3", "callable", "Fix:")


def test_passes_accept_callables_strings_and_pass_objects():
    obj = SimpleNamespace(name="mine", fn=module_level_pass)
    s = Strategy(passes=[module_level_pass, "pkg.mod:fn", obj])
    assert s.passes == (module_level_pass, "pkg.mod:fn", obj)


def test_passes_dict_form_is_validated():
    msg = _error(passes=[{"name": "x", "target": "a:b", "extra": 1}])
    _assert_names(msg, "passes[0]", "unknown key", "'extra'", "Fix:")
    msg = _error(passes=[{"name": "x", "target": "not a path"}])
    _assert_names(msg, "passes[0]['target']", "package.module:function", "Fix:")


# --------------------------------------------------------------------------- #
# Cross-field rules
# --------------------------------------------------------------------------- #


def test_interleaved_needs_virtual_stages():
    msg = _error(pp=2, schedule="interleaved-1f1b")
    _assert_names(msg, "schedule='interleaved-1f1b' with virtual_stages=1", "virtual_stages > 1", "Fix:", "virtual_stages=2")


def test_virtual_stages_need_interleaved():
    msg = _error(pp=2, virtual_stages=2)
    _assert_names(msg, "virtual_stages=2 with schedule='1f1b'", "Fix:", "schedule='interleaved-1f1b'")


def test_interleaved_needs_pp():
    msg = _error(schedule="interleaved-1f1b", virtual_stages=2)
    _assert_names(msg, "with pp=1", "two pipeline ranks", "Fix:", "pp > 1")


def test_interleaved_microbatches_multiple_of_pp():
    msg = _error(pp=4, schedule="interleaved-1f1b", virtual_stages=2, microbatches=6)
    _assert_names(msg, "microbatches=6 with pp=4", "multiple of pp", "Megatron", "Fix:", "microbatches=4", "microbatches=8")


def test_zero_bubble_needs_pp_and_one_chunk():
    msg = _error(schedule="zero-bubble")
    _assert_names(msg, "schedule='zero-bubble' with pp=1", "zero-bubble pipeline", "two pipeline ranks", "Fix:",
                  "pp > 1")
    msg = _error(pp=2, schedule="zero-bubble", virtual_stages=2, microbatches=4)
    _assert_names(msg, "virtual_stages=2 with schedule='zero-bubble'", "'zbv' (two)", "Fix:")
    assert Strategy(pp=2, schedule="zero-bubble", microbatches=3).microbatches == 3  # any count


@pytest.mark.parametrize("virtual", [1, 3])
def test_zbv_needs_exactly_two_chunks(virtual):
    msg = _error(pp=2, schedule="zbv", virtual_stages=virtual, microbatches=4)
    _assert_names(msg, f"schedule='zbv' with virtual_stages={virtual}", "exactly two chunks", "in a V",
                  "Fix: set virtual_stages=2")


def test_zbv_needs_pp():
    _assert_names(_error(schedule="zbv", virtual_stages=2), "schedule='zbv' with pp=1", "two pipeline ranks",
                  "Fix:")


def test_zbv_takes_any_microbatch_count_and_places_stages_in_a_v():
    s = Strategy(pp=4, schedule="zbv", virtual_stages=2, microbatches=3)
    assert [s.stage_rank(stage) for stage in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    # every other schedule loops: rank r holds r, r + pp, ...
    loop = Strategy(pp=4, schedule="interleaved-1f1b", virtual_stages=2, microbatches=4)
    assert [loop.stage_rank(stage) for stage in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    # a batch that does not split suggests any divisor: zbv has no multiple-of-pp rule
    _assert_names(str(pytest.raises(ValueError, s.check_batch, 8).value), "microbatches=2 or microbatches=4")


def test_interleaved_valid():
    s = Strategy(pp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=4)
    assert s.virtual_stages == 2


def test_partition_list_length_too_short():
    msg = _error(pp=4, partition=["layers.4"])
    _assert_names(msg, "partition=['layers.4'] with pp=4", "first stage begins at the model start",
                  "exactly 3 entries", "got 1", "Fix:")


def test_partition_list_length_counts_virtual_stages():
    msg = _error(pp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=2, partition=["a"])
    _assert_names(msg, "pp*virtual_stages=2*2=4", "exactly 3 entries")
    Strategy(pp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=2, partition=["a", "b", "c"])


def test_partition_list_including_the_first_stage():
    msg = _error(pp=2, partition=["layers.0", "layers.6"])
    _assert_names(msg, "exactly 1 entry", "Fix: drop the first entry ('layers.0')")


def test_partition_list_with_a_single_stage():
    _assert_names(_error(partition=["layers.6"]), "with pp=1", "exactly 0 entries", "Fix:", "pp > 1")


def test_sequence_parallel_needs_tp():
    msg = _error(sequence_parallel=True)
    _assert_names(msg, "sequence_parallel=True with tp=1", "tp > 1", "Fix:")
    assert Strategy(tp=2, sequence_parallel=True).sequence_parallel


# --------------------------------------------------------------------------- #
# Runtime checks
# --------------------------------------------------------------------------- #


def test_check_world_size_ok():
    Strategy(dp=2, tp=2, pp=2).check_world_size(8)


def test_check_world_size_suggests_dp():
    with pytest.raises(ValueError) as info:
        Strategy(dp=2, tp=2, pp=2).check_world_size(16)
    _assert_names(str(info.value), "dp=2", "tp=2", "pp=2", "= 8", "world_size=16", "Fix: use dp=4")


def test_check_world_size_when_tp_pp_does_not_divide():
    with pytest.raises(ValueError) as info:
        Strategy(tp=3).check_world_size(8)
    _assert_names(str(info.value), "tp=3", "world_size=8", "does not divide", "1, 2, 4, 8", "Fix:")


def test_check_world_size_rejects_bad_input():
    with pytest.raises(ValueError, match="world_size=0"):
        Strategy().check_world_size(0)


def test_check_batch_ok():
    Strategy(microbatches=4).check_batch(16)


def test_check_batch_suggests_divisors():
    with pytest.raises(ValueError) as info:
        Strategy(microbatches=4).check_batch(10)
    _assert_names(str(info.value), "microbatches=4", "10", "not divisible", "Fix:",
                  "microbatches=2", "microbatches=5", "12")


def test_check_batch_interleaved_suggestions_respect_pp():
    s = Strategy(pp=4, schedule="interleaved-1f1b", virtual_stages=2, microbatches=8)
    with pytest.raises(ValueError) as info:
        s.check_batch(12)
    msg = str(info.value)
    _assert_names(msg, "microbatches=4", "microbatches=12")
    assert "microbatches=6" not in msg


def test_check_batch_rejects_bad_input():
    with pytest.raises(ValueError, match="local_batch=-1"):
        Strategy().check_batch(-1)


# --------------------------------------------------------------------------- #
# Serialisation
# --------------------------------------------------------------------------- #


def _round_trip(s: Strategy) -> Strategy:
    return Strategy.from_dict(json.loads(json.dumps(s.to_dict())))


def test_json_round_trip_defaults():
    assert _round_trip(Strategy()) == Strategy()


def test_json_round_trip_everything():
    s = Strategy(
        dp=2, tp=2, pp=2, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2,
        partition=["layers.2", "layers.4", "layers.6"], sequence_parallel=True, offload_optimizer=True,
        offload_embedding=["model.embed_tokens", "lm_head"], param_dtype="bf16", reduce_dtype="bf16", seed=7,
        passes=["pkg.mod:fn", "other:Cls.static"], strict=True,
    )
    d = s.to_dict()
    assert d["param_dtype"] == d["reduce_dtype"] == "bfloat16"
    assert d["partition"] == ["layers.2", "layers.4", "layers.6"]
    assert d["offload_embedding"] == ["model.embed_tokens", "lm_head"]
    assert d["passes"] == ["pkg.mod:fn", "other:Cls.static"]
    assert _round_trip(s) == s


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_json_round_trip_param_dtype(dtype):
    assert _round_trip(Strategy(param_dtype=dtype)).param_dtype is dtype
    assert _round_trip(Strategy(param_dtype=dtype, reduce_dtype=dtype)).reduce_dtype is dtype


def test_a_dict_without_reduce_dtype_loads_with_fp32_gradients():
    d = Strategy(param_dtype="bf16").to_dict()
    del d["reduce_dtype"]  # written before the field existed
    assert Strategy.from_dict(d).gradient_dtype is torch.float32


def test_json_round_trip_type_regex():
    s = Strategy(pp=2, partition=r"type:^(GPT2Block|LlamaDecoderLayer)$", offload_embedding=True)
    assert _round_trip(s) == s


def test_to_dict_callable_becomes_import_path():
    d = Strategy(passes=[module_level_pass, os.path.join]).to_dict()
    assert d["passes"] == [f"{__name__}:module_level_pass", f"{os.path.join.__module__}:join"]
    json.dumps(d)


def test_to_dict_pass_object_and_its_round_trip():
    obj = SimpleNamespace(name="mine", fn=module_level_pass, after="fuse", before=("a", "b"))
    d = Strategy(passes=[obj]).to_dict()
    assert d["passes"] == [
        {"name": "mine", "target": f"{__name__}:module_level_pass", "after": "fuse", "before": ["a", "b"]}
    ]
    back = _round_trip(Strategy.from_dict(d))
    assert back.passes == tuple(d["passes"])
    assert _round_trip(back) == back


def test_to_dict_pass_object_without_ordering():
    d = Strategy(passes=[SimpleNamespace(name="n", fn=module_level_pass)]).to_dict()
    assert d["passes"][0]["after"] is None and d["passes"][0]["before"] is None


def test_to_dict_refuses_a_lambda():
    with pytest.raises(ValueError) as info:
        Strategy(passes=[lambda g: g]).to_dict()
    _assert_names(str(info.value), "passes[0]", "<lambda>", "lambda", "only module-level functions", "Fix:")


def test_to_dict_refuses_a_nested_function():
    def nested(graph):
        return graph

    with pytest.raises(ValueError) as info:
        Strategy(passes=[nested]).to_dict()
    _assert_names(str(info.value), "nested", "only module-level functions", "Fix:")


def test_to_dict_refuses_a_pass_object_with_a_lambda():
    with pytest.raises(ValueError, match=r"passes\[0\]\.fn"):
        Strategy(passes=[SimpleNamespace(name="n", fn=lambda g: g)]).to_dict()


def test_to_dict_refuses_an_unresolvable_callable():
    import functools

    with pytest.raises(ValueError, match="only module-level functions"):
        Strategy(passes=[functools.partial(module_level_pass)]).to_dict()


def test_from_dict_unknown_keys():
    with pytest.raises(ValueError) as info:
        Strategy.from_dict({"dp": 2, "micro_batches": 4, "tp_degree": 2, "bogus": 1})
    _assert_names(str(info.value), "'micro_batches'", "'tp_degree'", "'bogus'", "valid fields are",
                  "microbatches", "rename 'micro_batches' to 'microbatches'", "rename 'tp_degree' to 'tp'",
                  "remove 'bogus'")


def test_from_dict_validates_values():
    with pytest.raises(ValueError, match=r"Strategy\.pp=0"):
        Strategy.from_dict({"pp": 0})


def test_from_dict_keeps_pass_strings_unimported():
    s = Strategy.from_dict({"passes": ["definitely_not_a_module_xyz:fn"]})
    assert s.passes == ("definitely_not_a_module_xyz:fn",)


def test_from_dict_partial_uses_defaults():
    assert Strategy.from_dict({"dp": 4}) == Strategy(dp=4)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(TypeError, match="list"):
        Strategy.from_dict([("dp", 2)])


def test_coerce():
    s = Strategy(dp=2)
    assert Strategy.coerce(s) is s
    assert Strategy.coerce({"dp": 2}) == s
    with pytest.raises(TypeError) as info:
        Strategy.coerce("dp=2")
    _assert_names(str(info.value), "str", "graphpar.Strategy", "dict")


# --------------------------------------------------------------------------- #
# zero
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("value, fix", [("1", "zero=1"), (2.0, "zero=2"), (5, "zero=0"), (True, "zero=0"), (-1, "zero=0")])
def test_zero_must_be_a_stage(value, fix):
    msg = _error(dp=2, zero=value)
    _assert_names(msg, f"Strategy.zero={value!r}", "0 (nothing sharded), 1 (optimizer states), 2", f"Fix: use {fix}")


def test_every_zero_stage_is_accepted():
    assert [Strategy(dp=2, zero=z).zero for z in (0, 1, 2, 3)] == [0, 1, 2, 3]


@pytest.mark.parametrize("kwargs, names", [
    (dict(dp=2, zero=1, offload_embedding=["wte"]), ("zero=1 with offload_embedding=('wte',)", "not built yet",
                                                     "offload_embedding=False with zero")),
])
def test_zero_combinations_not_built_are_refused(kwargs, names):
    _assert_names(_error(**kwargs), *names)


def test_zero_round_trips_and_is_allowed_at_dp_1():
    assert Strategy(zero=1, param_dtype="bf16", offload_optimizer=True).param_dtype == torch.bfloat16
    assert Strategy(dp=2, zero=2, param_dtype="fp16").param_dtype == torch.float16  # loss-scaled, see zero.md
    s = Strategy(zero=2)  # a no-op at dp=1 (nothing to shard over), not an error
    assert s.zero == 2 and Strategy.from_dict(json.loads(json.dumps(s.to_dict()))) == s


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_composes_with_every_pipeline_schedule(zero):
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)):
        s = Strategy(dp=2, pp=2, zero=zero, microbatches=2, schedule=schedule, virtual_stages=virtual)
        assert (s.zero, s.pp, s.schedule) == (zero, 2, schedule)


@pytest.mark.parametrize("kwargs", [dict(dp=2, ep=2, zero=1), dict(dp=4, ep=2, zero=2),
                                    dict(dp=2, tp=2, ep=2, zero=2, param_dtype="bf16"), dict(dp=2, ep=2, param_dtype="bf16")])
def test_ep_composes_with_zero_1_2_and_param_dtype(kwargs):
    s = Strategy(**kwargs)
    assert s.ep == kwargs["ep"] and Strategy.from_dict(json.loads(json.dumps(s.to_dict()))) == s
