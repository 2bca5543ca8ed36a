"""ggml-attn has no layer to swap: transformers reaches it through its attention interface
(`model.set_attn_implementation("ggml-org/ggml-attn")` calls `flash_attn_forward`)."""

__all__: list[str] = []
