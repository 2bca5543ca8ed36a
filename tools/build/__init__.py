"""The builder: `python -m tools.build [package ...]` builds packages/<name>/build/<variant>/."""
