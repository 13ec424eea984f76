"""What an install claims: only the ``bubblefree`` name, and a torch-free core."""

from __future__ import annotations

import subprocess
import sys


def _printed(code: str, cwd) -> str:
    """What ``code`` prints, run from a folder outside the repository (only
    what the install provides); it must exit 0."""
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_layers_install_under_bubblefree_and_claim_no_top_level_name(tmp_path):
    assert _printed("import bubblefree.core, bubblefree.skills, bubblefree.fake_backend, bubblefree.bench\n"
                    "import importlib.util as u\n"
                    "print([n for n in ('core', 'skills', 'fake_backend', 'cuda_backend', 'bench')"
                    " if u.find_spec(n) is not None])", tmp_path) == "[]"


def test_the_core_the_skills_and_the_serving_layer_import_no_torch(tmp_path):
    # DESIGN.md: core/ is the sans-I/O heart; the fake backend and the serving
    # layer run where torch is not installed.
    assert _printed("import sys, bubblefree, bubblefree.core, bubblefree.skills, bubblefree.fake_backend\n"
                    "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'numpy'}))",
                    tmp_path) == "[]"


def test_without_pillow_the_engine_imports_and_an_image_names_the_extra(tmp_path):
    """The core, the skills, the fake backend and the serving layer need only
    attrs; Pillow comes with the images (and server) extras."""
    assert _printed("import sys\nsys.modules['PIL'] = None  # as if not installed\n"
                    "import bubblefree, bubblefree.core, bubblefree.skills, bubblefree.fake_backend\n"
                    "from bubblefree.images import load_image\n"
                    "try:\n    load_image(b'x')\nexcept ImportError as err:\n    print(err)\n",
                    tmp_path) == "images need Pillow: pip install 'bubblefree[images]'"
