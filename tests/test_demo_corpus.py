"""The documents the demo recipe derives from its corpus: edit copies, chat turns, probes."""

import ast
import random

import numpy as np

from specserve.tools.demo_corpus import (
    IGNORE_LABEL,
    chat_turn,
    copy_probe_pairs,
    edit_copy,
    functions,
    local_names,
    rename,
    repeat_row,
)

SOURCE = '''
class Box:
    def put(self, item, count=1):
        """Store count copies of item in the box."""
        total = self.size + count
        self.item = item
        for _ in range(count):
            self.items.append(item)
        return total
'''


def test_a_rename_changes_the_name_and_not_attributes_strings_or_other_names():
    ((node, code),) = functions(SOURCE)
    assert local_names(code) == ["item", "count", "total"]
    renamed = rename(code, "item", "entry")
    assert "self.item = entry" in renamed and "self.items.append(entry)" in renamed
    assert "copies of item" in renamed  # the docstring is kept
    ast.parse(renamed)


def test_edit_copies_repeat_the_function_and_chat_turns_answer_with_it():
    ((node, code),) = functions(SOURCE)
    rng = random.Random(0)
    documents = [d for d in (edit_copy(node, code, rng) for _ in range(20)) if d]
    assert documents and all(d.startswith(code) and d.count("def put(") == 2 for d in documents)
    turn = chat_turn(node, code, rng)
    assert turn.startswith("<|endoftext|><|user|>\n") and "\n<|assistant|>\ndef put(self, item, count=1):" in turn
    assert "tore count copies of item in the box" in turn.split("<|assistant|>")[0]


def test_copy_probe_pairs_are_a_function_and_its_renamed_copy():
    ((context, copy),) = copy_probe_pairs([SOURCE], 5, 0)
    assert context.rstrip("\n") == copy.replace("item_new", "item").rstrip("\n") and "item_new" in copy


def test_repeated_runs_repeat_and_leave_random_first_occurrences_out_of_the_loss():
    stream = np.arange(10_000, 20_000)  # corpus ids, disjoint from the random ones (4..8191)
    rng = np.random.default_rng(0)
    rows = [repeat_row(stream, 512, rng, 4, 8192) for _ in range(20)]
    assert all(tokens.shape == labels.shape == (512,) for tokens, labels in rows)
    # Ignored labels sit exactly on random ids, and only on some of them (their copies count).
    random_ids = np.concatenate([tokens < 8192 for tokens, _ in rows])
    ignored = np.concatenate([labels == IGNORE_LABEL for _, labels in rows])
    assert not (ignored & ~random_ids).any() and 0.3 < ignored.sum() / random_ids.sum() < 0.7
    # Kept labels are the tokens; most tokens after a run's first occurrence repeat an earlier one.
    for tokens, labels in rows:
        kept = labels != IGNORE_LABEL
        assert (labels[kept] == tokens[kept]).all()
    tokens = rows[0][0]
    seen_before = [t in set(tokens[:i].tolist()) for i, t in enumerate(tokens.tolist())]
    assert 0.3 < np.mean(seen_before) < 0.7
    # The same seed makes the same row (a resumed run sees the same batches).
    again = repeat_row(stream, 512, np.random.default_rng(0), 4, 8192)
    assert (again[0] == rows[0][0]).all() and (again[1] == rows[0][1]).all()
