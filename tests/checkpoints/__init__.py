"""Tests of checkpoint loading and saving, one module per part."""
