"""Rows in memory: the schema, shared-memory and CUDA segments, pages, row copies."""
