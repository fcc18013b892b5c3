"""Tests (a package: verl ships a top-level `tests` package that would shadow this directory otherwise)."""
