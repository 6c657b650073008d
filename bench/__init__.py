"""Benchmarks and reports: side-by-side runs, Markdown tables, PNG plots."""
