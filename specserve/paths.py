"""Where the repository's own files live (the demo models ship inside it)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODELS = REPO_ROOT / "models" / "demo"
DEMO_TARGET = DEMO_MODELS / "target"
DEMO_DRAFT = DEMO_MODELS / "draft"

# Files of which a model directory holds at least one where it has a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
