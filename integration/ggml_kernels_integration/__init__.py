"""Run transformers' GGUF models on ggml-kernels: `enable()`, then load as usual.

    import ggml_kernels_integration as gk
    gk.enable()
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=name)

`enable()` is thin, it rewrites no model code:
- points the Hub ids transformers asks for at our local builds (LOCAL_KERNELS), and resolves them
  as CPU builds even on a CUDA build of torch;
- maps the layer kernels (RMSNormZeroCentered, RMSNorm, Qwen3_5GatedDeltaNet, SoftmaxTopKRouter, and
  the Llama family's rotary_pos_emb function) for the CPU too (transformers maps them for "mps" only);
- keeps `llama` files (SmolLM2, ...) packed too: transformers sends them to its older loader, which
  dequantizes every weight (see `archs`);
- on the CPU routes what transformers keeps for itself there through our kernels: embeddings of
  packed tables (get_rows) and prefill matmuls on packed weights (mul_mat), so no weight is ever
  unpacked to a dense copy; on a CPU with bfloat16 dot products, prefill matmuls of 32-64 rows and
  more on block-32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) dequantize a chunk at a time with ggml and
  multiply in bfloat16, 2-5x faster than ggml's dot products for those types (see `dense_prefill`;
  `enable(dense_prefill=False)` keeps ggml's path);
- lets CPU key/value caches grow in place instead of being re-copied every step (see `kv_cache`);
- reads a GGUF's config without a numpy object per vocabulary entry (see `lean_metadata`);
- runs a layer's sibling projections (q/k/v, gate/up, ...) as one kernel call in decode steps (see
  `projection_groups`), and hands the memory the load freed back to the system.
"""

from __future__ import annotations

import os
from pathlib import Path

import tomllib
import torch

from . import archs, dense_prefill, kv_cache, lean_metadata, projection_groups
from .validate import GgufFileError, GgufSummary, check_gguf

__all__ = ["GgufFileError", "GgufSummary", "builds", "check_gguf", "enable"]

_dense_prefill_module = dense_prefill  # `enable`'s keyword has the module's name

REPO = Path(__file__).resolve().parents[2]
# kernel name transformers asks for -> (Hub id, layer class in that package)
LAYER_KERNELS = {
    "RMSNormZeroCentered": ("ggml-org/ggml-norm", "RMSNormZeroCentered"),
    "RMSNorm": ("ggml-org/ggml-norm", "RMSNorm"),
    "Qwen3_5GatedDeltaNet": ("ggml-org/ggml-gated-delta-net", "Qwen3_5GatedDeltaNet"),
    "SoftmaxTopKRouter": ("transformers-community/topk", "SoftmaxTopKRouter"),
    # the function kernel of the Llama family's apply_rotary_pos_emb
    "rotary_pos_emb": ("ggml-org/ggml-attn", "RotaryPosEmb"),
}

_state: dict = {}


def builds() -> dict[str, Path]:
    """Hub id -> package folder, for every package of this repo that has a build."""
    out = {}
    for toml in sorted((REPO / "packages").glob("*/build.toml")):
        with open(toml, "rb") as f:
            repo_id = tomllib.load(f)["general"]["hub"]["repo-id"]
        if any((toml.parent / "build").glob("torch*-cpu-*")):
            out[repo_id] = toml.parent
    return out


def _variant_dir(package: Path) -> Path:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    abi = "cxx11" if torch._C._GLIBCXX_USE_CXX11_ABI else "cxx98"
    return package / "build" / f"torch{major}{minor}-{abi}-cpu-x86_64-linux"


def enable(*, dense_prefill: bool = True) -> None:
    """Make transformers' GGUF path run on ggml-kernels (idempotent). See the module docstring.

    dense_prefill: prefill matmuls on block-32 weights take `dense_prefill` (ggml's dequantize and a
    bfloat16 GEMM) where it is faster; False keeps ggml-quantization's `mul_mat` for every prefill
    matmul (8-bit activations, as llama.cpp). The last call's value holds."""
    _dense_prefill_module.set_enabled(dense_prefill)
    if _state.get("enabled"):
        return
    import kernels
    from kernels import LocalLayerRepository, Mode
    from transformers.integrations import hub_kernels
    from transformers.integrations.gguf import kernels as gguf_kernels
    from transformers.integrations.gguf import utils as gguf_utils

    ours = builds()
    if "ggml-org/ggml-quantization" not in ours:
        raise RuntimeError("ggml-quantization is not built: run `python tools/build.py` (or `nox -s build`)")
    mapping = ":".join(f"{repo}={path}" for repo, path in ours.items())
    os.environ["LOCAL_KERNELS"] = ":".join(p for p in (os.environ.get("LOCAL_KERNELS"), mapping) if p)

    # Our builds are CPU builds: resolve our ids with backend="cpu" whatever torch was built for.
    original_get_kernel = hub_kernels.get_kernel_hub

    def get_kernel(repo_id, *args, **kwargs):
        if repo_id in ours and torch.version.cuda:
            kwargs.setdefault("backend", "cpu")
        return original_get_kernel(repo_id, *args, **kwargs)

    hub_kernels.get_kernel_hub = get_kernel
    gguf_kernels._gguf_kernel = None  # forget a lookup made before enable()

    # Layer kernels for the devices we build for (the build folder itself: no Hub call, no backend
    # guess). transformers drops a layer whose every entry does not load, and its "mps" entries ask
    # the Hub for a version, so a layer we build replaces transformers' entry instead of joining it.
    original_mapping = gguf_kernels.get_ggml_layer_mapping

    def layer_mapping() -> dict:
        out = original_mapping()
        for layer, (repo_id, layer_class) in LAYER_KERNELS.items():
            if repo_id in ours:
                repo = LocalLayerRepository(repo_path=_variant_dir(ours[repo_id]), layer_name=layer_class)
                out[layer] = {"cpu": {Mode.INFERENCE: repo}}
        return out

    gguf_kernels.get_ggml_layer_mapping = layer_mapping

    # Architectures transformers still sends to its dequantizing loader (llama: SmolLM2, ...).
    archs.register()

    # transformers copies each tensor out of the memory-mapped file, and the mapped pages it read
    # stay resident until the whole load ends: the peak was the file twice. Drop them as it goes.
    _release_mapped_pages_after_each_tensor()

    # Decode steps append to the key/value cache in place instead of re-copying it (see kv_cache),
    # keys and values with one ggml-attn call where that build has it.
    write = None
    if "ggml-org/ggml-attn" in ours:
        attn = kernels.get_kernel("ggml-org/ggml-attn", version=1, **({"backend": "cpu"} if torch.version.cuda else {}))
        write = attn.ops.kv_write.default if hasattr(attn, "kv_write") else None
    kv_cache.install(write)

    # Config reads parse the tokenizer's arrays without a numpy view per entry (see lean_metadata).
    lean_metadata.install()

    # A damaged or unsupported file fails on its first header read (the config's), in one clear
    # sentence, before a model is built (see `validate`).
    _check_files_before_transformers_reads_them()

    # On the CPU transformers unpacks embeddings and prefill weights with its own torch code
    # (kernel_can_read is False there): our get_rows / mul_mat read the packed blocks directly.
    original_can_read = gguf_kernels.kernel_can_read

    def kernel_can_read(tensor) -> bool:
        return gguf_kernels.get_gguf_kernel() is not False and (tensor.device.type == "cpu" or original_can_read(tensor))

    gguf_kernels.kernel_can_read = kernel_can_read
    quant = kernels.get_kernel("ggml-org/ggml-quantization", version=1, **({"backend": "cpu"} if torch.version.cuda else {}))
    original_unpack = gguf_utils.GgufLinear._unpack_matmul

    def unpack_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        if self.weight.device.type != "cpu":
            return original_unpack(self, flat)
        if _dense_prefill_module.applies(self.ggml_type, flat.shape[0]):
            out = _dense_prefill_module.matmul(quant, self.weight, flat, self.ggml_type, self.out_features)
        else:
            out = quant.mul_mat(self.weight, flat, self.ggml_type, self.out_features)
        return out.to(flat.dtype)

    gguf_utils.GgufLinear._unpack_matmul = unpack_matmul

    # Decode steps: a layer's sibling projections (q/k/v, gate/up, ...) in one kernel call each.
    projection_groups.patch_forward(quant)
    _after_each_gguf_load(projection_groups.install, _return_freed_memory)

    _state.update(enabled=True, quant=quant)


def _after_each_gguf_load(*steps) -> None:
    """Run `step(model)` for each step once transformers has loaded a GGUF model's weights."""
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    original = GgufHfQuantizer._process_model_after_weight_loading

    def after_loading(self, model, **kwargs):
        model = original(self, model, **kwargs)
        if self.supported and not self.quantization_config.dequantize:
            for step in steps:
                step(model)
        return model

    GgufHfQuantizer._process_model_after_weight_loading = after_loading


def _return_freed_memory(model=None) -> None:
    """Hand the heap memory the load freed back to the system (glibc's malloc_trim).

    Loading copies every tensor out of the file through temporaries; glibc keeps what they freed
    for reuse, and on a Qwen3.5-0.8B-shaped file that was ~45 MiB resident for the rest of the
    process (and under the peak of the first prefill). No-op where the C library has no malloc_trim."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _check_files_before_transformers_reads_them() -> None:
    import transformers.integrations.gguf as gguf_package
    from transformers.integrations.gguf import reader
    from transformers.quantizers import quantizer_gguf

    original = reader.read_gguf_metadata
    checked: set = set()

    def read_gguf_metadata(gguf_path, *args, **kwargs):
        stat = os.stat(gguf_path) if os.path.isfile(gguf_path) else None
        key = (os.path.realpath(gguf_path), stat and stat.st_size, stat and stat.st_mtime_ns)
        if key not in checked:
            check_gguf(gguf_path)
            checked.add(key)
        return original(gguf_path, *args, **kwargs)

    reader.read_gguf_metadata = read_gguf_metadata
    gguf_package.read_gguf_metadata = read_gguf_metadata  # config / tokenizer import it from here
    quantizer_gguf.read_gguf_metadata = read_gguf_metadata


def _release_mapped_pages_after_each_tensor() -> None:
    import ctypes
    import mmap

    from transformers.integrations.gguf import reader

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    original = reader.LazyGgufTensor.__getitem__

    def getitem(self, key):
        tensor = original(self, key)  # a copy: the mapping is not referenced any more
        start = self.data.ctypes.data
        first, end = start // page * page, start + self.data.nbytes
        # the mapping is read-only and file-backed: dropped pages are read again from the file if
        # anything touches them (a page shared with the next tensor, say)
        libc.madvise(first, end - first, mmap.MADV_DONTNEED)
        return tensor

    reader.LazyGgufTensor.__getitem__ = getitem
