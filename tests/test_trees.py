"""Token trees: shapes as requests write them, and the target's tree forward, whose every node
gets the logits of the chain along its path, to the bit (greedy tree output is then
target-only output)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specserve.methods.trees import (
    MAX_TREE_NODES,
    TreeShape,
    TreeShapeError,
    branches,
    depths,
    prune_to_branches,
    renumber,
)
from specserve.model.backends import RunnerBackend, TreeNodes
from specserve.model.runner import LlamaRunner
from tests.test_runner import COMMON

CPU = torch.device("cpu")


def test_shapes_from_children_per_depth_and_from_paths_agree():
    per_depth = TreeShape.parse([2, 1])
    assert per_depth == TreeShape.parse("2,1") == TreeShape.parse([[0], [1], [0, 0], [1, 0]])
    assert per_depth.nodes == ((0, 0), (1, 0), (0, 1), (3, 0))  # depth-first: the first chain first
    assert per_depth.describe() == "[[0],[0,0],[1],[1,0]]"
    assert TreeShape.parse([1, 1, 1]) == TreeShape.chain(3) and TreeShape.chain(3).is_chain
    assert not per_depth.is_chain and per_depth.depth() == 2


@pytest.mark.parametrize(
    "value, message",
    [
        ([[0], [1, 0]], "needs its prefix"),
        ([[0], [0]], "listed twice"),
        ([0, 2], "positive integers"),
        ([[-1]], "integers >= 0"),
        ([4, 4], f"at most {MAX_TREE_NODES}"),
        ("[[0],", "cannot read"),
        ({"a": 1}, "children per depth"),
    ],
)
def test_bad_shapes_are_refused_with_what_is_wrong(value, message):
    with pytest.raises(TreeShapeError, match=message):
        TreeShape.parse(value)


def test_branches_and_pruning_keep_whole_paths():
    parents = [-1, 0, 1, 2, 0, 4, 1]  # root; chain 1-2-3; 4-5 beside it; 6 under 1
    assert depths(parents) == [0, 1, 2, 3, 1, 2, 2]
    assert branches(parents) == [[0, 1, 2], [0, 2], [0], [0], [1], [1], [2]]
    kept = prune_to_branches(parents, 2)
    assert kept == [0, 1, 2, 3, 4, 5]
    assert renumber(parents, [0, 1, 4, 5]) == [-1, 0, 0, 2]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    directory = tmp_path_factory.mktemp("tree-target")
    model.half().save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    "compiled",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="needs a compiler"),
        ),
    ],
)
def test_every_tree_node_gets_the_logits_of_the_chain_along_its_path(target_dir, compiled):
    """One forward over a tree of 7 nodes on 3 branches (cache slots): each node's logits
    equal, bitwise, those of a verify of its path as a chain; keeping a side branch leaves
    the sequence's cache as a chain along it would, and the branches are synced again before
    the next tree."""
    torch._dynamo.reset()
    runner = LlamaRunner(str(target_dir), CPU, torch.float32, num_slots=6, max_len=256, compile_steps=compiled)
    backend = RunnerBackend(runner)
    prompt = list(range(7, 80))
    parents = [-1, 0, 1, 2, 0, 4, 1]
    tokens = [prompt[-1], 5, 9, 11, 2, 8, 3]
    tree, chain = backend.open(), backend.open()
    for sequence in (tree, chain):
        backend.forward_with_argmax([_row(sequence, prompt[:-1])])
    assert backend.reserve_branches(tree, 3) == 3
    on = branches(parents)
    ((logits, argmax),) = backend.forward_trees([TreeNodes(tree, len(prompt) - 1, tokens, depths(parents), on)])
    assert tree.length == len(prompt) - 1  # the tree is not the sequence yet
    for node in range(len(parents)):
        path = _path(parents, node)
        chain.truncate(len(prompt) - 1)
        ((expected, _),) = backend.forward_with_argmax([_row(chain, [tokens[n] for n in path], len(path))])
        assert torch.equal(logits[node], expected[-1]), f"node {node} (path {path})"
        if argmax is not None:
            assert argmax[node] == int(expected[-1].argmax())

    # Keep the path root-4-5 (branch 1): the next token's logits are the chain's.
    backend.keep_branch(tree, 1, len(prompt) + 2)
    chain.truncate(len(prompt) - 1)
    backend.forward_with_argmax([_row(chain, [tokens[0], tokens[4], tokens[5]])])
    ((after_tree, _),) = backend.forward_with_argmax([_row(tree, [7])])
    ((after_chain, _),) = backend.forward_with_argmax([_row(chain, [7])])
    assert torch.equal(after_tree, after_chain)

    # A second tree after it reads the kept tokens on every branch.
    ((second, _),) = backend.forward_trees([TreeNodes(tree, tree.length, [4, 6, 1], [0, 1, 1], [[0, 1], [0], [1]])])
    for token, row in ((6, 1), (1, 2)):
        chain.truncate(tree.length)
        ((expected, _),) = backend.forward_with_argmax([_row(chain, [4, token], 2)])
        assert torch.equal(second[row], expected[-1])

    # A new session takes a branch's slot when none is free: sessions come first.
    opened = [backend.open() for _ in range(runner.free_slots + len(tree.branch_slots))]
    assert tree.branch_slots == [] and len(opened) == 4
    assert backend.reserve_branches(tree, 3) == 1


def _row(sequence, tokens, num_logits=1):
    from specserve.model.backends import ForwardRow

    return ForwardRow(sequence, tokens, num_logits)


def _path(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("shape", [[2, 2, 1], [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [1], [1, 0], [0, 1]]])
def test_the_verifiers_tree_rounds_make_the_target_only_tokens(tiny_pair, shape):
    """Greedy tree rounds, drafted and verified in the verifier, make target-only's tokens."""
    from specserve.speculation import Speculation
    from tests.test_engines import _colocated_verifier, _decode

    verifier = _colocated_verifier(tiny_pair)
    prompt = (104, 105, 104, 105, 104, 105, 32, 7)
    _, plain = _decode(verifier, "plain", prompt, 41)
    tree = TreeShape.parse(shape)
    _, rounds = _decode(verifier, "tree", prompt, 41, Speculation("draft_model", len(tree), False, tree=tree))
    tokens = [t for o in rounds for t in (*o.accepted_token_ids, o.next_token_id)]
    assert tokens == [o.next_token_id for o in plain]
    assert any(o.num_draft_tokens == len(tree) for o in rounds)
    assert all(o.num_accepted <= tree.depth() for o in rounds)
    assert len(rounds) < len(plain)
    session = verifier.sessions["tree"]
    assert session.sequence.branch_slots  # the tree's branches kept their slots between rounds


@pytest.mark.parametrize("stack_name", ["stack", "split_stack"])
def test_greedy_tree_rounds_through_the_stack_make_the_target_only_tokens(request, stack_name):
    """Trees drafted by the verifier itself, or by a draft service and verified by a Verify
    call, beside chains and target-only requests in the same batches."""
    from tests.test_e2e import PROMPTS, complete

    stack = request.getfixturevalue(stack_name)
    trees = ([2, 2, 1], [[0], [0, 0], [0, 0, 0], [1], [0, 1]], [3], ("early_exit", [2, 1, 1]))
    jobs = [(prompt, tree) for prompt in PROMPTS[:3] for tree in (*trees, None)]

    def run(job):
        prompt, tree = job
        method, tree = tree if isinstance(tree, tuple) else ("draft_model", tree)
        speculation = {"method": "none"} if tree is None else {"method": method, "tree": tree, "adaptive": False}
        return complete(stack.url, prompt=list(prompt), max_tokens=40, temperature=0, return_token_ids=True,
                        speculation=speculation)  # fmt: skip

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = dict(zip(((p, str(t)) for p, t in jobs), pool.map(run, jobs)))
    for prompt in PROMPTS[:3]:
        reference = results[(prompt, "None")]["choices"][0]["token_ids"]
        for tree in trees:
            body = results[(prompt, str(tree))]
            assert body["choices"][0]["token_ids"] == reference, tree
    # Alone, a request speculates whatever the stack's limit (a CPU stack's is one request).
    reference = results[(PROMPTS[1], "None")]["choices"][0]["token_ids"]
    for tree in trees:
        body = run((PROMPTS[1], tree))
        assert body["choices"][0]["token_ids"] == reference
        speculation = body["usage"]["speculation"]
        assert speculation["num_drafts"] >= 1 and speculation["num_accepted_tokens"] >= 1, tree


@pytest.mark.parametrize("stack_name", ["stack", "split_stack"])
def test_sampled_tree_rounds_follow_the_target_distribution(request, stack_name):
    """1200 seeded requests at temperature 1 with three siblings at the first depth: the
    second token (kept child or the residual's draw) follows the target exactly."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_e2e import PROMPTS, _chi_square, _target_first_two_token_distributions, token_ids

    stack = request.getfixturevalue(stack_name)
    prompt = list(PROMPTS[0])

    def run(seed):
        return token_ids(stack.url, prompt, max_tokens=3, temperature=1.0, seed=seed,
                         speculation={"tree": [3, 1], "adaptive": False})  # fmt: skip

    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(run, range(1200)))
    first, second = _target_first_two_token_distributions(stack.target_dir, prompt)
    assert _chi_square([o[0] for o in outputs], first) > 1e-3
    assert _chi_square([o[1] for o in outputs], second) > 1e-3
    assert _chi_square([o[1] for o in outputs], first) < 1e-3  # the test can tell them apart
