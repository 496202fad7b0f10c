"""The proto is the contract: stubs are current and every field and RPC is documented."""

from __future__ import annotations

import re

from specserve.tools.protogen import proto_files, stale_files


def test_committed_stubs_are_current():
    assert stale_files() == [], "run `specserve gen-protos` and commit the result"


def test_every_field_rpc_and_message_has_a_comment():
    declaration = re.compile(r"^\s*(rpc |message |service |(repeated |optional )?[\w.]+ \w+ = \d+;)")
    for path in proto_files():
        lines = path.read_text().splitlines()
        assert "package specserve.v1;" in lines, f"{path.name}: versioned package"
        for number, line in enumerate(lines):
            if declaration.match(line):
                assert lines[number - 1].strip().startswith("//"), (
                    f"{path.name}:{number + 1}: {line.strip()} lacks a comment"
                )
