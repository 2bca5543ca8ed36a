"""Whole-model benchmarks (bench_e2e), A/B runs of one integration feature (ab_decode), the demo, and
the markdown tables of the per-package benchmarks (kernels_table: packages/<name>/benchmarks/ run by
kernels' own runner, `kernels benchmark`)."""
