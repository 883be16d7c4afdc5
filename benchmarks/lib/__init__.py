"""Modules that benchmark scripts import, not scripts themselves (tests/benchmarks/test_smoke.py
runs every benchmarks/*.py as one): what a script holds that is large enough for a module of its own."""
