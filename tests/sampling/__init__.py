"""Tests of exact sampling at temperature > 0, one module per part."""
