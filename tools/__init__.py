"""Developer tools of the monorepo, one subpackage per job. Run them from the repository root as
modules (`python -m tools.build ggml-attn`); pytest finds them through pyproject's `pythonpath`.

    build/    the builder: ggml's pinned sources, its CPU runtime, the packages' variant folders
    testing/  what tests share: loading our builds as users do, the llama.cpp ggml oracle (ctypes)
    bench/    whole-model benchmarks, A/B runs, the demo, tables of the packages' benchmarks
    models/   GGUF model files for tests and benchmarks: generated (make_gguf) and downloaded
    publish.py  the packages' build/ variants to the Hugging Face Hub (docs/publishing.md)
"""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
