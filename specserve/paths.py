"""Where the repository's own files live (the demo models ship inside it)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODELS = REPO_ROOT / "models" / "demo"
DEMO_TARGET = DEMO_MODELS / "target"
DEMO_DRAFT = DEMO_MODELS / "draft"
DEMO_MEDUSA = DEMO_MODELS / "medusa"  # the demo target's Medusa heads

# Files of which a model directory holds at least one where it has a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def missing_tokenizer(directory) -> str | None:
    """Why directory holds no tokenizer, in words to end a sentence with; None where it has one."""
    if any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return f"no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): copy the model's tokenizer there"
