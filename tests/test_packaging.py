"""Our top-level `kernels` package must never make transformers think Hugging Face's
`kernels` package is installed (transformers would then try to load hub kernels from it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_transformers_does_not_take_our_kernels_package_for_hugging_faces(tiny_pair):
    target_dir, _ = tiny_pair
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        from pathlib import Path
        spec = importlib.util.find_spec("kernels")
        assert spec is not None and Path(spec.origin).parent.name == "kernels", spec  # ours is importable
        from transformers import AutoModelForCausalLM
        from transformers.utils.import_utils import is_kernels_available
        from transformers.integrations import hub_kernels
        model = AutoModelForCausalLM.from_pretrained({str(target_dir)!r})
        model(**{{"input_ids": __import__("torch").tensor([[1, 2, 3]])}})
        assert not is_kernels_available(), "transformers believes hub kernels are installed"
        assert "kernels" not in sys.modules, "transformers imported our kernels package"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr


def test_our_kernels_package_defines_no_version():
    import kernels

    assert not hasattr(kernels, "__version__")
