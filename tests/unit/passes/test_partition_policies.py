"""Tests for graphpar.passes.partition_policies: the pipeline partition policies and their exact balancing."""

import random
import time
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphpar.passes.partition_policies import Unit, balance, describe_partition, partition, unit_weights
from tests.helpers import best_splits, held_elements


# --------------------------------------------------------------------------- #
# Model unit lists
# --------------------------------------------------------------------------- #


def conv(cin: int, cout: int, k: int) -> int:
    return cin * cout * k * k + cout  # weight + bias


def linear(fin: int, fout: int) -> int:
    return fin * fout + fout  # weight + bias


# Hand-computed from the layer sizes, so the test does not depend on torchvision.
CONV1, CONV2, CONV3, CONV4, CONV5 = 23_296, 307_392, 663_936, 884_992, 590_080
FC6, FC7, FC8 = 37_752_832, 16_781_312, 4_097_000


def alexnet_units() -> list[Unit]:
    """torchvision AlexNet's layers in execution order (21 units)."""
    features = [
        ("Conv2d", CONV1), ("ReLU", 0), ("MaxPool2d", 0),
        ("Conv2d", CONV2), ("ReLU", 0), ("MaxPool2d", 0),
        ("Conv2d", CONV3), ("ReLU", 0),
        ("Conv2d", CONV4), ("ReLU", 0),
        ("Conv2d", CONV5), ("ReLU", 0), ("MaxPool2d", 0),
    ]
    classifier = [
        ("Dropout", 0), ("Linear", FC6), ("ReLU", 0),
        ("Dropout", 0), ("Linear", FC7), ("ReLU", 0),
        ("Linear", FC8),
    ]
    return (
        [Unit(f"features.{i}", t, p, True) for i, (t, p) in enumerate(features)]
        + [Unit("avgpool", "AdaptiveAvgPool2d", 0, False)]
        + [Unit(f"classifier.{i}", t, p, True) for i, (t, p) in enumerate(classifier)]
    )


EMBED = 50_000 * 768
TIED = (("embed.weight", EMBED),)  # the LM head reads the embedding's table


def gpt_units(blocks: int = 12) -> list[Unit]:
    return (
        [Unit("embed", "Embedding", EMBED, False, tied=TIED)]
        + [Unit(f"blocks.{i}", "Block", 7_087_872, True) for i in range(blocks)]
        + [Unit("norm", "LayerNorm", 1536, False), Unit("lm_head", "Linear", EMBED, False, tied=TIED)]
    )


def paths(units, bounds, k):
    ends = list(bounds[1:]) + [len(units)]
    return [u.path for u in units[bounds[k]:ends[k]]]


def error(units, stages, policy) -> str:
    with pytest.raises(ValueError) as info:
        partition(units, stages, policy)
    return str(info.value)


def assert_names(msg: str, *parts: str) -> None:
    for part in parts:
        assert part in msg, f"{part!r} missing from: {msg}"


# --------------------------------------------------------------------------- #
# "parameters"
# --------------------------------------------------------------------------- #


def test_hand_computed_alexnet_parameter_counts():
    assert (CONV1, CONV2, CONV3, CONV4, CONV5) == (
        conv(3, 64, 11), conv(64, 192, 5), conv(192, 384, 3), conv(384, 256, 3), conv(256, 256, 3))
    assert (FC6, FC7, FC8) == (linear(9216, 4096), linear(4096, 4096), linear(4096, 1000))
    assert sum(u.params for u in alexnet_units()) == 61_100_840  # torchvision's published count


def test_alexnet_two_stages_by_parameters_matches_deepspeed():
    units = alexnet_units()
    bounds = partition(units, 2, "parameters")
    # DeepSpeed gives parts [0, 19, 22] on its 22-layer AlexNet: the last stage is
    # exactly the last two Linear layers (and the ReLU between them). The Dropout
    # before classifier.4 weighs nothing and stays with the stage before.
    assert paths(units, bounds, 1) == ["classifier.4", "classifier.5", "classifier.6"]
    assert bounds == [0, 18]
    stage0 = sum(u.params for u in units[:18])
    assert stage0 == CONV1 + CONV2 + CONV3 + CONV4 + CONV5 + FC6 == 40_222_528


def test_parameters_rejects_negative_counts():
    units = [Unit("a", "Linear", 10, True), Unit("b", "Linear", -1, True)]
    assert_names(error(units, 2, "parameters"), "'b'", "params=-1")


# --------------------------------------------------------------------------- #
# "uniform"
# --------------------------------------------------------------------------- #


def test_uniform_gives_three_blocks_per_stage():
    units = gpt_units(12)
    bounds = partition(units, 4, "uniform")
    per_stage = [[p for p in paths(units, bounds, k) if p.startswith("blocks.")] for k in range(4)]
    assert [len(s) for s in per_stage] == [3, 3, 3, 3]
    # embed leads stage 0; norm and lm_head (weight 0) stay with the last blocks.
    assert paths(units, bounds, 0)[0] == "embed"
    assert paths(units, bounds, 3)[-2:] == ["norm", "lm_head"]
    assert bounds == [0, 4, 7, 10]


def test_uniform_without_repeated_units_counts_every_unit():
    units = [Unit(f"m{i}", "Linear", 1, False) for i in range(6)]
    assert unit_weights(units, "uniform") == [1] * 6
    assert partition(units, 3, "uniform") == [0, 2, 4]


# --------------------------------------------------------------------------- #
# "type:<regex>"
# --------------------------------------------------------------------------- #


def test_type_regex_is_case_insensitive_search():
    units = (
        [Unit("embed", "Embedding", 100, False)]
        + [Unit(f"h.{i}", "GPT2TransformerBlock", 10, True) for i in range(8)]
        + [Unit("ln_f", "LayerNorm", 2, False)]
    )
    bounds = partition(units, 4, "type:transformer")
    assert [sum(p.startswith("h.") for p in paths(units, bounds, k)) for k in range(4)] == [2, 2, 2, 2]


def test_type_regex_alternation_on_alexnet():
    units = alexnet_units()
    # 5 convs + 3 linears = 8 matching units: 4 per stage; stage 1 starts at conv5.
    assert partition(units, 2, "type:conv|LINEAR") == [0, 10]


def test_type_regex_matching_nothing_names_regex_types_and_a_suggestion():
    msg = error(alexnet_units(), 2, "type:Block")
    assert_names(msg, "'Block'", "Conv2d", "ReLU", "Linear", "Dropout", "AdaptiveAvgPool2d", "Fix:",
                 "partition='type:Conv2d|Linear'")


def test_type_regex_near_miss_is_suggested():
    assert_names(error(gpt_units(4), 2, "type:Blok"), "partition='type:Block'")


def test_type_regex_that_does_not_compile():
    assert_names(error(gpt_units(4), 2, "type:Block("), "'Block('", "does not compile", "Fix:")


# --------------------------------------------------------------------------- #
# "profile"
# --------------------------------------------------------------------------- #


def test_profile_balances_seconds_and_keeps_free_units_with_the_previous_stage():
    units = [Unit(f"l{i}", "Linear", 1, True, s) for i, s in enumerate([1.0, 2.0, 3.0, 0.0, 4.0])]
    # Splits before l3 and before l4 both give max 6 s; the later one keeps l3 in stage 0.
    assert partition(units, 2, "profile") == [0, 4]


def test_profile_is_exact_on_inexact_floats():
    seconds = [0.1, 0.2, 0.3, 0.1, 0.7, 0.05, 0.35]
    units = [Unit(f"l{i}", "Linear", 1, True, s) for i, s in enumerate(seconds)]
    for stages in range(1, len(seconds) + 1):
        assert_optimal_and_latest(seconds, stages, partition(units, stages, "profile"))


def test_profile_without_measurements_or_with_bad_times():
    units = gpt_units(4)
    assert_names(error(units, 2, "profile"), "seconds == 0", "Fix:", "partition='parameters'")
    bad = [Unit("a", "Block", 1, True, 1.0), Unit("b", "Block", 1, True, float("nan"))]
    assert_names(error(bad, 2, "profile"), "'b'", "seconds=nan", "Fix:")


# --------------------------------------------------------------------------- #
# Explicit module-path lists
# --------------------------------------------------------------------------- #


def test_explicit_paths():
    units = gpt_units(12)
    assert partition(units, 3, ["blocks.4", "blocks.8"]) == [0, 5, 9]
    assert partition(units, 2, ("lm_head",)) == [0, 14]
    assert partition(units, 1, []) == [0]


def test_explicit_path_may_name_a_parent_module_but_only_at_a_dot():
    units = [Unit(p, "Linear", 1, True) for p in ["embed", "layers.10.mlp", "layers.1.attn", "layers.1.mlp"]]
    assert partition(units, 2, ["layers.1"]) == [0, 2]  # not "layers.10.mlp"
    assert partition(units, 2, ["layers"]) == [0, 1]


def test_explicit_unknown_path_suggests_close_matches():
    msg = error(gpt_units(12), 3, ["blocks.4", "block.8"])
    assert_names(msg, "'block.8'", "not the path of any pipeline unit", "Fix:", "'blocks.8'")


def test_explicit_out_of_order_suggests_the_sorted_list():
    msg = error(gpt_units(12), 3, ["blocks.8", "blocks.4"])
    assert_names(msg, "['blocks.8', 'blocks.4']", "execution order", "Fix:", "['blocks.4', 'blocks.8']")


def test_explicit_entries_resolving_to_the_same_unit():
    msg = error(gpt_units(12), 3, ["blocks", "blocks.0"])
    assert_names(msg, "'blocks'", "'blocks.0'", "both begin at unit 1", "Fix:")


def test_explicit_first_unit_would_empty_stage_zero():
    msg = error(gpt_units(12), 2, ["embed"])
    assert_names(msg, "['embed']", "stage 0 would be empty", "Fix:")


@pytest.mark.parametrize(
    "stages, value, fix",
    [
        (3, ["blocks.4"], "list exactly 2 module paths"),
        (2, ["embed", "blocks.6"], "drop the first entry ('embed')"),
        (1, ["blocks.6"], "nothing to split"),
    ],
)
def test_explicit_wrong_count(stages, value, fix):
    msg = error(gpt_units(12), stages, value)
    assert_names(msg, repr(value), f"{stages} stages need exactly {stages - 1}", "Fix:", fix)


def test_explicit_non_string_entry():
    assert_names(error(gpt_units(4), 2, [3]), "non-empty module path string", "Fix:")


# --------------------------------------------------------------------------- #
# General errors
# --------------------------------------------------------------------------- #


def test_more_stages_than_units():
    msg = error(gpt_units(2), 6, "parameters")
    assert_names(msg, "stages=6", "5 units", "at least one unit", "Fix:", "at most 5 stages")


@pytest.mark.parametrize("stages", [0, -1, True, 2.0])
def test_bad_stage_count(stages):
    assert_names(error(gpt_units(4), stages, "parameters"), f"stages={stages!r}", "Fix:")


def test_no_units():
    assert_names(error([], 1, "parameters"), "no units", "Fix:")


def test_unknown_policy_suggests_closest():
    assert_names(error(gpt_units(4), 2, "paramters"), "'paramters'", "Fix:", "partition='parameters'")
    assert_names(error(gpt_units(4), 2, "blocks.2"), "partition=['blocks.2']")
    assert_names(error(gpt_units(4), 2, 3), "got int", "Fix:")


# --------------------------------------------------------------------------- #
# describe_partition
# --------------------------------------------------------------------------- #


def test_describe_partition_table():
    units = alexnet_units()
    text = describe_partition(units, [0, 18], "parameters")
    lines = text.splitlines()
    assert "'parameters'" in lines[0] and "2 stage(s)" in lines[0]
    assert lines[1].split() == ["stage", "units", "first", "last", "count", "params", "weight"]
    assert lines[2].split() == ["0", "0-17", "features.0", "classifier.3", "18", "40,222,528", "40,222,528"]
    assert lines[3].split() == ["1", "18-20", "classifier.4", "classifier.6", "3", "20,878,312", "20,878,312"]
    assert "heaviest: stage 0" in lines[4]


def test_describe_partition_for_paths_and_profile():
    units = gpt_units(4)
    text = describe_partition(units, [0, 3], ["blocks.2"])
    assert text.splitlines()[2].split()[-1] == "-"
    timed = [Unit(f"l{i}", "Linear", 1, True, 0.25) for i in range(4)]
    assert describe_partition(timed, [0, 2], "profile").splitlines()[2].split()[-1] == "0.5"


def test_describe_partition_rejects_bad_bounds():
    with pytest.raises(ValueError, match="Fix: pass the list returned by partition"):
        describe_partition(gpt_units(4), [1, 3], "parameters")


# --------------------------------------------------------------------------- #
# Exactness against brute force
# --------------------------------------------------------------------------- #


def summed(weights):
    exact = [Fraction(w) for w in weights]  # Fraction(float) is exact
    return lambda a, b: sum(exact[a:b])


def assert_optimal_and_latest(weights, stages, bounds, stage_weight=None):
    """`bounds` is the optimum of brute force and its latest split; a stage weighs the sum
    of its weights unless `stage_weight(start, end)` says otherwise."""
    stage_weight = stage_weight or summed(weights)
    best, optimal = best_splits(len(weights), stages, stage_weight)
    assert len(bounds) == stages and bounds[0] == 0
    assert all(a < b for a, b in zip(bounds, bounds[1:])) and bounds[-1] < len(weights)
    ends = list(bounds[1:]) + [len(weights)]
    assert max(stage_weight(a, b) for a, b in zip(bounds, ends)) == best
    # The documented tie-break: every boundary at or after that of any optimal partition.
    assert all(all(r >= o for r, o in zip(bounds, other)) for other in optimal), (weights, bounds, optimal)
    assert bounds == max(optimal)


# Zeros are frequent so that ties, and the tie-break, are exercised.
_int_weights = st.lists(st.one_of(st.just(0), st.integers(0, 9)), min_size=1, max_size=9)
_float_weights = st.lists(
    st.one_of(st.just(0.0), st.floats(0, 10, allow_nan=False, allow_infinity=False)), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), weights=st.one_of(_int_weights, _float_weights))
def test_balance_matches_brute_force_hypothesis(data, weights):
    stages = data.draw(st.integers(1, len(weights)), label="stages")
    assert_optimal_and_latest(weights, stages, balance(weights, stages))


def test_balance_matches_brute_force_seeded():
    rng = random.Random(1234)
    for _ in range(300):
        n = rng.randint(1, 10)
        weights = [rng.choice([0, 0, 1, 2, 3, rng.randint(0, 50)]) for _ in range(n)]
        if rng.random() < 0.3:
            weights = [w * rng.random() for w in weights]
        stages = rng.randint(1, n)
        assert_optimal_and_latest(weights, stages, balance(weights, stages))


def units_reading(reads):
    """Units from each one's reads ({parameter: elements}), tied where another reads it too."""
    readers = [name for unit in reads for name in unit]
    return [Unit(f"u{i}", "Linear", sum(unit.values()), True,
                 tied=tuple((n, size) for n, size in unit.items() if readers.count(n) > 1))
            for i, unit in enumerate(reads)]


# A few parameter names, so that units often read the same one (a tied weight)
_reads = st.lists(st.dictionaries(st.sampled_from("abcdefg"), st.just(0) | st.integers(1, 9), max_size=3),
                  min_size=1, max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), reads=_reads)
def test_parameters_with_tied_weights_match_brute_force_hypothesis(data, reads):
    # each parameter has one size wherever it is read
    sizes = {name: size for unit in reads for name, size in unit.items()}
    reads = [{name: sizes[name] for name in unit} for unit in reads]
    stages = data.draw(st.integers(1, len(reads)), label="stages")
    bounds = partition(units_reading(reads), stages, "parameters")
    assert_optimal_and_latest(reads, stages, bounds, lambda a, b: held_elements(reads, a, b))


def test_tied_embedding_counts_on_both_stages():
    units = gpt_units(12)
    bounds = partition(units, 2, "parameters")
    reads = [dict(u.tied) or {u.path: u.params} for u in units]
    assert_optimal_and_latest(reads, 2, bounds, lambda a, b: held_elements(reads, a, b))
    # both stages hold the table, so the blocks split evenly: 6 and 6
    assert paths(units, bounds, 1) == [f"blocks.{i}" for i in range(6, 12)] + ["norm", "lm_head"]
    table = describe_partition(units, bounds, "parameters").splitlines()
    assert table[2].split()[-2:] == [f"{EMBED + 6 * 7_087_872:,}"] * 2
    assert table[3].split()[-2:] == [f"{EMBED + 6 * 7_087_872 + 1536:,}"] * 2


def test_balance_edges():
    assert balance([5], 1) == [0]
    assert balance([0, 0, 0, 0], 4) == [0, 1, 2, 3]
    assert balance([0, 0, 0, 0], 2) == [0, 3]  # all ties: latest boundary
    assert balance([1, 1, 1, 1], 3) == [0, 2, 3]
    with pytest.raises(ValueError):
        balance([1, -1], 1)
    with pytest.raises(ValueError):
        balance([1, 2], 3)


# --------------------------------------------------------------------------- #
# Performance
# --------------------------------------------------------------------------- #


@pytest.mark.serial  # a time budget: alone on the machine
@pytest.mark.parametrize("policy", ["parameters", "profile", "uniform", "type:Block"])
def test_4000_units_into_64_stages_is_fast(policy):
    rng = random.Random(7)
    units = [
        Unit(f"blocks.{i}", rng.choice(["Block", "ReLU", "Linear"]), rng.randint(0, 10**9), rng.random() < 0.8,
             rng.random() * 1e-2)
        for i in range(4000)
    ]
    start = time.perf_counter()
    bounds = partition(units, 64, policy)
    elapsed = time.perf_counter() - start
    assert len(bounds) == 64 and bounds[0] == 0 and all(a < b for a, b in zip(bounds, bounds[1:]))
    assert elapsed < 1.0, f"{policy}: {elapsed:.3f} s"


@pytest.mark.serial  # a time budget: alone on the machine
def test_4000_units_explicit_paths_is_fast():
    units = [Unit(f"blocks.{i}.mlp", "MLP", 1, True) for i in range(4000)]
    value = [f"blocks.{i}" for i in range(60, 4000, 62)][:63]
    start = time.perf_counter()
    bounds = partition(units, 64, value)
    assert time.perf_counter() - start < 1.0
    assert bounds[1:] == [int(p.split(".")[1]) for p in value]
