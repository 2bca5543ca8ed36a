"""GGUF model files for tests and benchmarks: generated ones with random weights (make_gguf) and the
real SmolLM2-135M, downloaded once (smollm2)."""
