"""What both builds of the packages (CPU: build/, emulated Metal: build-metal-emu/) refuse before any
work, and the memory a large call leaves behind.

- `kv_write` takes float32, float16 and bfloat16 caches only (TypeError): a float64 or integer
  cache reached ggml's SET_ROWS on Metal, whose assert ended the process.
- No op reads or makes a tensor above MAX_TENSOR_BYTES (2^35 bytes, kMaxTensorBytes in
  common/ggml_torch.h), counted as numel * element size, an expanded (stride-0) dim in full: a
  ValueError naming the tensor, before any copy or allocation. The requests here are 64-256 GiB
  built from a few KiB with expand(), so a copy or an output allocation before the check would fail
  in torch's allocator (or take the machine's memory) instead.
- A call returns its memory: the Metal device buffer is kept between calls only up to
  GraphMemory::kKeptBytes (64 MiB), a bigger one is freed when its call returns; measured in a
  fresh process from /proc/self/status.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from tools.testing.kernel_testing import fresh_process
from tools.testing.metal_builds import load

BUILDS = ["build", "build-metal-emu"]
LIMIT_MESSAGE = r"ggml-kernels takes tensors of at most 32 GiB \(2\^35 bytes\)"


def run_in_fresh_process(body: str) -> dict:
    """`body` (sets `res`, JSON) in a new interpreter: a crash there fails the test, not pytest."""
    code = "import json\n" + textwrap.dedent(body) + "\nprint('RESULT' + json.dumps(res))\n"
    done = fresh_process(code)
    assert done.returncode == 0, f"the process ended with {done.returncode}: {done.stderr[-2000:]}"
    return json.loads(done.stdout.rsplit("RESULT", 1)[1])


def each_build(package: str):
    """A module-scoped fixture, named after the package's short name, holding each of its BUILDS."""
    return pytest.fixture(scope="module", params=BUILDS)(lambda request: load(package, request.param))


attn = each_build("ggml-attn")
quant = each_build("ggml-quantization")
norm = each_build("ggml-norm")
topk = each_build("topk")


# ---- kv_write's cache dtypes ----------------------------------------------------------------


def test_kv_write_refuses_other_cache_dtypes_on_both_builds():
    res = run_in_fresh_process("""
        import torch
        from tools.testing.metal_builds import load
        res = {}
        for folder in ("build", "build-metal-emu"):
            attn = load("ggml-attn", folder)
            for dtype in (torch.float64, torch.int32, torch.int64, torch.uint8):
                keys = torch.zeros(1, 2, 8, 16, dtype=dtype)
                rows = torch.ones(1, 2, 1, 16, dtype=dtype)
                try:
                    attn.kv_write(keys, keys.clone(), rows, rows.clone(), 0)
                    res[f"{folder} {dtype}"] = "written"
                except TypeError as e:
                    res[f"{folder} {dtype}"] = str(e).splitlines()[0] + (" (touched)" if keys.any() else "")
    """)
    names = {"torch.float64": "Double", "torch.int32": "Int", "torch.int64": "Long", "torch.uint8": "Byte"}
    assert len(res) == 2 * len(names)
    for key, message in res.items():
        assert message == f"keys must have dtype Float, Half, BFloat16; got {names[key.split()[1]]}", key


def test_kv_write_fake_refuses_other_cache_dtypes(attn):
    keys, rows = torch.empty(1, 2, 8, 16, dtype=torch.float64, device="meta"), torch.empty(1, 2, 1, 16, device="meta")
    with pytest.raises(TypeError, match="keys must have dtype Float, Half, BFloat16; got Double"):
        attn.kv_write(keys, keys, rows.double(), rows.double(), 0)


# ---- tensors above the size limit, refused before any copy ------------------------------------


def expanded(*shape, dtype=torch.float32):
    """A tensor of `shape` over one row of memory (stride 0 in every dim but the last)."""
    return torch.zeros(shape[-1], dtype=dtype).expand(*shape)


def test_the_limit_is_the_kernels_one(norm, topk):
    assert norm._ggml_runtime.MAX_TENSOR_BYTES == topk._ggml_runtime.MAX_TENSOR_BYTES == 2**35


def test_expanded_activation_refused_before_any_copy(norm):
    x = expanded(2**24, 4096)  # 256 GiB of float32 over 16 KiB
    pattern = r"x of shape \[16777216, 4096\] and dtype Float would take 256 GiB; " + LIMIT_MESSAGE
    with pytest.raises(ValueError, match=pattern):
        norm.rms_norm(x, eps=1e-6)
    with pytest.raises(ValueError, match=pattern):
        norm.l2_norm(x)


def test_expanded_logits_refused_before_the_wrappers_reshape(topk):
    # (E, 0, 1) strides: reshape(-1, E) cannot be a view, it would copy 256 GiB
    logits = torch.zeros(2**10, 1, 64).expand(2**10, 2**20, 64)
    with pytest.raises(ValueError, match=r"logits of shape \[1024, 1048576, 64\] and dtype Float would take 256 GiB"):
        topk.softmax_top_k(logits, 2)


def test_expanded_indices_refused(quant):
    t = int(quant.types.GGMLType.Q8_0)
    blocks = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"indices of shape \[8589934592\] and dtype Long would take 64 GiB"):
        quant.get_rows(blocks, torch.zeros(1, dtype=torch.long).expand(2**33), t, 32)
    # 2 GiB of indices, but their rows would take 2^28 * 256 * 4 bytes = 256 GiB
    with pytest.raises(ValueError, match=r"the gathered rows of shape \[268435456, 256\] and dtype Float would take 256 GiB"):
        quant.get_rows(torch.zeros(4, 272, dtype=torch.uint8), torch.zeros(1, dtype=torch.long).expand(2**28), t, 256)


def test_product_above_the_limit_refused(quant):
    """Inputs within the limit (16 GiB of expanded x, a 1024-row weight), a 64 GiB product."""
    t = int(quant.types.GGMLType.Q8_0)
    blocks = torch.zeros(1024, 8 * 34, dtype=torch.uint8)
    x = expanded(2**24, 256)
    with pytest.raises(ValueError, match=r"the product of shape \[16777216, 1024\] and dtype Float would take 64 GiB"):
        quant.mul_mat(blocks, x, t, 1024)
    with pytest.raises(ValueError, match=r"the product of shape \[16777216, 2, 1024\] and dtype Float would take 128 GiB"):
        quant.mul_mat_id(blocks[None], x, torch.zeros(1, 2, dtype=torch.long).expand(2**24, 2), t, 1024)


def test_attention_mask_above_the_limit_refused(attn):
    """65535 queries over 2^19 keys: a 64 GiB causal mask, from 16 MiB of queries and expanded keys."""
    q = torch.zeros(1, 1, 65535, 64)
    kv = expanded(1, 1, 2**19, 64)
    with pytest.raises(ValueError, match=r"the additive f16 causal mask of shape \[65535, 524288\] and dtype Half"):
        attn.flash_attn(q, kv, kv, causal=True)


# ---- memory returned after a large call ---------------------------------------------------------


@pytest.mark.parametrize("folder", BUILDS)
def test_large_call_returns_its_memory(folder):
    """A 64 MiB rms_norm (64 MiB in, 64 MiB out: a 128 MiB Metal graph, above the 64 MiB kept):
    resident memory after the result is freed is back within 16 MiB of what it was before the call
    (the device buffer used to stay at the largest graph's size for the life of the process)."""
    res = run_in_fresh_process(f"""
        import torch
        from tools.testing.metal_builds import load

        def rss():
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

        norm = load("ggml-norm", {folder!r})
        norm.rms_norm(torch.randn(4, 4096), eps=1e-6)  # loads the runtime and its kernels
        x = torch.randn(4096, 4096)
        before = rss()
        y = norm.rms_norm(x, eps=1e-6)
        during = rss()
        del y
        res = {{"grew": during - before, "left": rss() - before}}
    """)
    assert res["grew"] >= 60 * 2**20, res  # the output at least: the measurement sees the call
    assert res["left"] < 16 * 2**20, res
