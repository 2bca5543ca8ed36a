"""Peak memory and time of transformers' config read of a GGUF file (`load_gguf_checkpoint(path,
return_tensors=False)`, what AutoConfig and AutoTokenizer run for `llama`-family files), with gguf-py's
own reader and with `ggml_kernels_integration.lean_metadata`, each in a fresh process.

    python -m tools.bench.config_read_memory --gguf SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CODE = """
import json, resource, sys, time
import torch, transformers, gguf  # imported before the baseline is taken
from transformers import modeling_gguf_pytorch_utils as utils
if sys.argv[2] == "lean":
    from ggml_kernels_integration import lean_metadata
    from ggml_kernels_integration.patching import PatchSet
    lean_metadata.install(PatchSet())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
out = utils.load_gguf_checkpoint(sys.argv[1], return_tensors=False)
seconds = time.perf_counter() - start
peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({"seconds": seconds, "peak_mib": peak, "tokens": len(out["tokenizer"].get("tokens", []))}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for _ in range(args.rounds):
        for reader in ("gguf-py", "lean"):
            proc = subprocess.run([sys.executable, "-c", CODE, args.gguf, reader], capture_output=True, text=True)
            if proc.returncode:
                sys.exit(proc.stderr[-2000:])
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{reader:8s} {r['seconds']:.2f} s, peak +{r['peak_mib']:.0f} MiB over the imports ({r['tokens']} tokens)")


if __name__ == "__main__":
    main()
