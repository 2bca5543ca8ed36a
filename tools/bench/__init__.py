"""Whole-model benchmarks (bench_e2e), A/B runs of one integration feature (ab_decode), the demo
and the timing helpers the package benchmarks share (benchutil)."""
