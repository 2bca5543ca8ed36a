"""`python -m ggml_kernels_integration ...`: the CLI (see `cli`)."""

from .cli import main

raise SystemExit(main())
