"""The import name `kernels` belongs to Hugging Face's package, which transformers requires and
imports; our Triton kernels live in kernels/ but import as `specserve_kernels`."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_transformers_loads_a_model_from_the_repository_root_beside_our_kernels(tiny_pair):
    # Run from the repository root, which `python -c` puts first on sys.path: kernels/ there must
    # not shadow Hugging Face's package (transformers imports it while loading a model).
    target_dir, _ = tiny_pair
    script = textwrap.dedent(
        f"""
        import importlib.util
        from pathlib import Path
        import torch
        from transformers import AutoModelForCausalLM
        import specserve_kernels.rejection as ours
        assert Path(ours.__file__).parent == Path({str(REPO_ROOT / "kernels")!r}), ours.__file__
        model = AutoModelForCausalLM.from_pretrained({str(target_dir)!r})
        model(input_ids=torch.tensor([[1, 2, 3]]))
        spec = importlib.util.find_spec("kernels")
        theirs = spec and spec.origin and Path(spec.origin).parent
        assert theirs != Path({str(REPO_ROOT / "kernels")!r}), f"`kernels` resolves to ours: {{spec}}"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr


def test_our_distribution_installs_no_package_named_kernels():
    # pip would write it over Hugging Face's site-packages/kernels/.
    top_level = importlib.metadata.distribution("specserve").read_text("top_level.txt").split()
    assert "specserve_kernels" in top_level and "kernels" not in top_level, top_level


def test_every_package_of_the_source_is_in_the_distribution():
    """pyproject.toml lists the packages by hand (kernels/ installs under another name): a new
    package missing there imports in an editable install and not in the Docker image's."""
    import tomllib

    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(REPO_ROOT).parts)
        for top in ("specserve", "gateway", "draft_service", "verify_service")
        for init in (REPO_ROOT / top).rglob("__init__.py")
    }
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
