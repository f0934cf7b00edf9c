"""Tree buffers, tree validation, dense and optimised trees (paper 2.1.2, 2.3.3), on hand-drawn cases."""

from __future__ import annotations

import re

import pytest
import torch

import medusa_core.trees
from medusa_core import (
    TREE_PRESETS,
    build_tree_buffers,
    chain_tree,
    dense_tree,
    optimal_tree,
    resolve_tree,
    validate_tree,
)

# The worked example of MEDUSA_FACTS.md. Node order (root, then sorted by (len, path)):
# 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [0,2], 6 [1,0], 7 [1,1], 8 [1,2].
WORKED_CHOICES = [[0], [0, 0], [0, 1], [0, 2], [1], [1, 0], [1, 1], [1, 2]]
PUBLISHED = [
    "mc_sim_7b_63",
    "vicuna_7b_stage2",
    "vicuna_7b_stage1_ablation",
    "vicuna_7b_stage1",
    "vicuna_13b_stage2",
    "vicuna_13b_stage1",
    "vicuna_33b_stage2",
    "vicuna_33b_stage1",
    "zephyr_stage2",
]


def test_worked_example_matches_the_reference_index_buffers():
    b = build_tree_buffers(WORKED_CHOICES)
    assert b.tree_indices.tolist() == [0, 1, 2, 11, 12, 13, 11, 12, 13]
    assert b.position_ids.tolist() == [0, 1, 1, 2, 2, 2, 2, 2, 2]
    assert b.retrieve_indices.tolist() == [[0, 2, 8], [0, 2, 7], [0, 2, 6], [0, 1, 5], [0, 1, 4], [0, 1, 3]]
    assert b.num_nodes == 9 and b.depth == 2


def test_worked_example_attention_mask_lets_each_node_see_only_itself_and_its_ancestors():
    b = build_tree_buffers(WORKED_CHOICES)
    visible = {
        0: {0}, 1: {0, 1}, 2: {0, 2},
        3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 1, 5},
        6: {0, 2, 6}, 7: {0, 2, 7}, 8: {0, 2, 8},
    }  # fmt: skip
    expected = torch.zeros(9, 9, dtype=torch.bool)
    for row, cols in visible.items():
        expected[row, list(cols)] = True
    assert b.attn_mask.dtype == torch.bool
    assert torch.equal(b.attn_mask, expected)
    assert b.parents.tolist() == [-1, 0, 0, 1, 1, 1, 2, 2, 2]
    assert b.path_lengths.tolist() == [3] * 6


def test_paths_of_uneven_depth_are_padded_with_minus_one_and_carry_their_true_length():
    # sorted: 1 [0], 2 [1], 3 [0,0]; leaves walked backwards: [0,0] then [1]; [0] is a prefix.
    b = build_tree_buffers([[0], [0, 0], [1]])
    assert b.retrieve_indices.tolist() == [[0, 1, 3], [0, 2, -1]]
    assert b.path_lengths.tolist() == [3, 2]
    assert b.node_heads() == [-1, 0, 0, 1]
    assert b.node_ranks() == [0, 0, 1, 0]


def test_node_order_does_not_depend_on_the_order_the_paths_are_given_in():
    shuffled = [[1, 2], [0], [1, 0], [0, 2], [1], [0, 1], [1, 1], [0, 0]]
    a, b = build_tree_buffers(WORKED_CHOICES), build_tree_buffers(shuffled)
    assert a.choices == b.choices
    assert torch.equal(a.retrieve_indices, b.retrieve_indices)
    assert torch.equal(a.attn_mask, b.attn_mask)


@pytest.mark.parametrize(
    "choices, message",
    [
        ([[0], [1, 0]], "path [1, 0] has no parent [1]"),
        ([[0], [0, 0], [0]], "path [0] appears twice"),
        ([[0], [0, -1]], "path [0, -1]"),
        ([[0], []], "empty path []"),
    ],
    ids=["not_prefix_closed", "duplicate", "negative_rank", "empty_path"],
)
def test_an_invalid_tree_is_rejected_with_a_message_naming_the_offending_path(choices, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_tree_buffers(choices)


def test_a_tree_deeper_than_the_heads_is_rejected_naming_the_path_and_its_depth():
    validate_tree(chain_tree(3), num_heads=3)  # fits exactly
    with pytest.raises(ValueError, match=re.escape("path [0, 0, 0] has depth 3")) as err:
        validate_tree(chain_tree(3), num_heads=2)
    assert "2 Medusa heads" in str(err.value)


@pytest.mark.parametrize(
    "sizes, nodes",
    [([3], 3), ([2, 3], 8), ([3, 2, 2], 21), ([1, 1, 1, 1], 4), ([4, 3, 2, 1], 64)],
)
def test_dense_tree_has_the_sum_over_depths_of_the_products_of_sizes_nodes(sizes, nodes):
    # Σ_k Π_{i≤k} s_i, worked by hand: [4,3,2,1] → 4 + 12 + 24 + 24 = 64.
    paths = dense_tree(sizes)
    assert len(paths) == nodes
    assert len({tuple(p) for p in paths}) == nodes
    b = build_tree_buffers(paths)  # valid: prefix-closed and unique
    assert b.num_nodes == nodes + 1 and b.depth == len(sizes)
    assert all(p[d] < sizes[d] for p in paths for d in range(len(p)))


def test_dense_tree_rejects_an_empty_size_list_and_zero_sizes():
    with pytest.raises(ValueError):
        dense_tree([])
    with pytest.raises(ValueError):
        dense_tree([2, 0])


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_published_preset_has_63_nodes_and_depth_4_except_vicuna_33b_stage1(name):
    b = build_tree_buffers(TREE_PRESETS[name])
    assert b.num_nodes == 64
    assert b.depth == (3 if name == "vicuna_33b_stage1" else 4)
    assert int(b.path_lengths.max()) == b.depth + 1


def test_optimal_tree_picks_the_highest_value_nodes_of_a_hand_made_accuracy_table():
    # a[k][i]: head 0 ranks 0.6 / 0.2, head 1 ranks 0.5 / 0.1. Node values by hand:
    # [0]=.6, [0,0]=.3, [1]=.2, [1,0]=.1, [0,1]=.06, [1,1]=.02.
    table = [[0.6, 0.2], [0.5, 0.1]]
    paths, expected = optimal_tree(table, 3)
    assert paths == [[0], [0, 0], [1]]
    assert expected == pytest.approx(0.6 + 0.3 + 0.2)
    paths, expected = optimal_tree(table, 5)
    assert paths == [[0], [0, 0], [1], [1, 0], [0, 1]]
    assert expected == pytest.approx(1.26)


def test_optimal_tree_prefers_a_deep_chain_when_the_top_ranks_are_very_accurate():
    # [0]=.9, [0,0]=.81, [0,0,0]=.729 beat [1]=.05.
    paths, expected = optimal_tree([[0.9, 0.05], [0.9, 0.05], [0.9, 0.05]], 3)
    assert paths == [[0], [0, 0], [0, 0, 0]]
    assert expected == pytest.approx(2.439)


def test_optimal_tree_stops_when_the_table_has_no_more_nodes_than_the_budget():
    paths, expected = optimal_tree([[0.6, 0.2], [0.5, 0.1]], 100)
    assert sorted(paths) == [[0], [0, 0], [0, 1], [1], [1, 0], [1, 1]]
    assert expected == pytest.approx(0.6 + 0.3 + 0.06 + 0.2 + 0.1 + 0.02)


def test_resolve_tree_understands_chain_and_dense_names_and_names_lists_custom():
    assert resolve_tree("chain_3") == ("chain_3", [[0], [0, 0], [0, 0, 0]])
    assert resolve_tree("dense_2x2") == ("dense_2x2", [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]])
    assert resolve_tree([[0], [1]]) == ("custom_2", [[0], [1]])
    name, choices = resolve_tree("mc_sim_7b_63")
    assert name == "mc_sim_7b_63" and choices == TREE_PRESETS["mc_sim_7b_63"]


def test_resolving_a_preset_returns_a_copy_the_caller_may_change():
    _, choices = resolve_tree("chain_4")
    choices[0].append(5)
    choices.append([9])
    assert TREE_PRESETS["chain_4"] == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]


def test_resolve_tree_rejects_an_unknown_name_and_an_invalid_list():
    with pytest.raises(ValueError, match="no_such_tree"):
        resolve_tree("no_such_tree")
    with pytest.raises(ValueError, match=re.escape("path [2, 0] has no parent [2]")):
        resolve_tree([[0], [2, 0]])


def test_a_chain_or_dense_name_too_deep_or_too_large_is_refused_before_the_tree_is_built(monkeypatch):
    # Building chain_99999999 first took ~22 GB before the depth check could refuse it.
    monkeypatch.setattr(medusa_core.trees, "chain_tree", lambda depth: pytest.fail(f"built a chain of depth {depth}"))
    monkeypatch.setattr(medusa_core.trees, "dense_tree", lambda sizes: pytest.fail(f"built a dense tree {sizes}"))
    with pytest.raises(ValueError, match=re.escape("tree 'chain_99999999' has depth 99999999 but the model has only 4")):
        resolve_tree("chain_99999999", num_heads=4)
    with pytest.raises(ValueError, match=re.escape("tree 'chain_99999999' has 100000000 nodes (root included); at most 1024")):
        resolve_tree("chain_99999999")
    with pytest.raises(ValueError, match=re.escape("tree 'dense_1000x1000' has 1001001 nodes (root included); at most 64")):
        resolve_tree("dense_1000x1000", max_nodes=64)


def test_a_list_of_paths_larger_than_the_node_limit_is_refused_with_its_size():
    with pytest.raises(ValueError, match=re.escape("the tree has 11 nodes (root included); at most 10 are allowed")):
        resolve_tree(chain_tree(10), max_nodes=10)
    assert resolve_tree(chain_tree(9), max_nodes=10)[0] == "custom_9"


def test_a_rank_outside_the_vocabulary_is_refused_naming_the_path_and_the_vocabulary_size():
    validate_tree([[0], [0, 95]], vocab_size=96)
    with pytest.raises(ValueError, match=re.escape("path [0, 96]: rank 96 is not below the vocabulary size 96")):
        validate_tree([[0], [0, 96]], vocab_size=96)
    with pytest.raises(ValueError, match=re.escape("rank 100 is not below the vocabulary size 96")):
        resolve_tree([[100]], vocab_size=96)


@pytest.mark.parametrize(
    "choices, message",
    [([0, 1], "path 0 is not a list of ranks"), ("[[0]]", "a tree is a non-empty list of paths"), ([], "non-empty")],
    ids=["flat_list", "string", "empty"],
)
def test_a_tree_that_is_not_a_list_of_paths_is_refused_with_a_value_error(choices, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_tree(choices)
