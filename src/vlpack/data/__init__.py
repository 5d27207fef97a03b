"""Data pipeline: sources → encode → plan → THD batch → loader."""
