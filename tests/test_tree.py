import json

import pytest
import torch

from ppd import Tree, TreeBuffers, TreeSet
from ppd.tree_builder import build_tree_set


def hand_tree() -> Tree:
    # root -> (0) -> (0, 0); root -> (1). Attached: root 2, (0) 1, (1) 1, (0, 0) 2.
    return Tree(paths=((1,), (0,), (0, 0)), prompt_tokens=(1, 1, 2), root_prompt_tokens=2)


def test_buffers_hand_checked():
    b = TreeBuffers.build(hand_tree(), key=2, num_prompt_tokens=2, num_ensemble=1,
                          attention_type="ensemble", top_k=4)
    # Rows: 0 root, 1 (0), 2 (1), 3 (0,0); prompt rows: root p0 p1 (4, 5), (0) p0 (6), (1) p0 (7), (0,0) p0 p1 (8, 9)
    assert b.num_nodes == 4 and b.num_rows == 10 and b.depth == 2
    assert b.candidate_index.tolist() == [0, 1, 4]  # (depth-1) * K + rank
    assert b.parent_row.tolist() == [0, 0, 1]
    assert b.prompt_index.tolist() == [0, 1, 0, 0, 0, 1]
    assert b.position_offset.tolist() == [0, 1, 1, 2, 1, 2, 2, 2, 3, 4]
    assert b.max_offset == 4
    expected = torch.zeros(10, 10, dtype=torch.bool)
    for row, sees in {
        0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3],
        4: [0, 4], 5: [0, 4, 5], 6: [0, 1, 6], 7: [0, 2, 7], 8: [0, 1, 3, 8], 9: [0, 1, 3, 8, 9],
    }.items():
        expected[row, sees] = True
    assert torch.equal(b.allowed, expected)
    assert b.retrieve_indices.tolist() == [[0, 2, 0], [0, 1, 3]]  # leaves (1) and (0, 0)
    assert b.retrieve_valid.tolist() == [[True, True, False], [True, True, True]]
    assert b.node_prompt_count.tolist() == [2, 1, 1, 2]
    assert b.node_prompt_rows.tolist() == [[4, 5], [6, 0], [7, 0], [8, 9]]


def test_buffers_ensemble_copies_share_positions_and_chains():
    tree = Tree(paths=(), prompt_tokens=(), root_prompt_tokens=2)
    b = TreeBuffers.build(tree, key=1, num_prompt_tokens=2, num_ensemble=2, attention_type="ensemble", top_k=3)
    assert b.num_rows == 5
    assert b.prompt_index.tolist() == [0, 1, 2, 3]
    assert b.position_offset.tolist() == [0, 1, 1, 2, 2]
    # copy 0 of token 2 (row 3) sees the root, copy 0 of token 1 (row 1) and itself
    assert b.allowed[3].nonzero().flatten().tolist() == [0, 1, 3]
    assert b.allowed[4].nonzero().flatten().tolist() == [0, 2, 4]


def test_tree_rejects_orphans_duplicates_and_bad_sets():
    with pytest.raises(ValueError, match="no parent"):
        Tree(((0, 0),), (1,), 1)
    with pytest.raises(ValueError, match="twice"):
        Tree(((0,), (0,)), (1, 1), 1)
    with pytest.raises(ValueError, match="deeper than its key"):
        TreeSet(2, 4, {1: Tree(((0,), (0, 0)), (1, 1), 1), 2: Tree((), (), 1)})
    with pytest.raises(ValueError, match="outside top-4"):
        TreeSet(1, 4, {1: Tree(((4,),), (1,), 1)})
    with pytest.raises(ValueError, match=r"in 1\.\.2"):
        TreeSet(2, 4, {1: Tree((), (), 3), 2: Tree((), (), 1)})
    with pytest.raises(ValueError, match="depth keys 1..2"):
        TreeSet(2, 4, {1: Tree((), (), 1)})


def test_tree_set_json_round_trip(tmp_path):
    trees = TreeSet(2, 4, {1: Tree(((0,),), (2,), 1), 2: hand_tree()}, {"note": "hand"})
    path = tmp_path / "trees.json"
    trees.save(path)
    assert TreeSet.load(path) == trees
    data = json.loads(path.read_text())
    assert data["trees"]["2"]["nodes"][0] == {"path": [1], "prompt_tokens": 1}


def test_tree_file_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        TreeSet.load(bad)
    bad.write_text(json.dumps({"top_k": 3}))
    with pytest.raises(ValueError, match="not a ppd tree file"):
        TreeSet.load(bad)
    bad.write_text(json.dumps([[0], [0, 0]]))  # a list of paths, not a tree set
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        TreeSet.load(bad)


def test_packaged_default_trees_load():
    trees = TreeSet.packaged()
    assert trees.num_prompt_tokens == 3 and trees.top_k == 10
    assert all(tree.num_rows(1) <= trees.metadata["budget"] for tree in trees.trees.values())


@pytest.mark.parametrize("budget,V", [(8, 1), (30, 1), (64, 1), (40, 2)])
def test_builder_respects_budget_and_keys(budget, V):
    acc = [[0.5 * 0.5**r for r in range(5)], [0.3 * 0.5**r for r in range(5)], [0.2 * 0.5**r for r in range(5)]]
    trees = build_tree_set(acc, budget, num_ensemble=V)
    for key, tree in trees.trees.items():
        assert tree.num_rows(V) <= budget
        assert tree.depth <= key
    # More rows never build a tree with fewer candidates.
    bigger = build_tree_set(acc, budget + 20, num_ensemble=V)
    assert all(len(bigger.trees[k].paths) >= len(trees.trees[k].paths) for k in trees.trees)
