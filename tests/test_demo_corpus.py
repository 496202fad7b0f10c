"""The documents the demo recipe derives from its corpus: edit copies, chat turns, probes."""

import ast
import random

from specserve.tools.demo_corpus import chat_turn, copy_probe_pairs, edit_copy, functions, local_names, rename

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
