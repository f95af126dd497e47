"""Tests for the example scripts in examples/ (launched as users run them)."""
