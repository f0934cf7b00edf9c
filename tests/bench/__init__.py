"""Tests of the benchmark program (``medusa_core.bench``), one module per part."""
