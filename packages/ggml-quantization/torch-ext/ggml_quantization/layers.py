"""ggml-quantization has no layers of its own: transformers' GgufLinear / GgufExperts /
GgufEmbedding call the functions of this package directly."""

__all__: list[str] = []
