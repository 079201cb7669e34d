"""Configuration (PURE): the model, the value parsers, the section tables, the YAML reader.

Two layers, with the core between them (pyproject.toml's layers contract): the model,
values, accounts and secret_files are read by the core and the wire formats; the
tables, the reader and what is written from the tables (defaults, schema, reference,
summary) ask the schedulers' registry (core/schedulers) what each algorithm reads and
accepts.
"""
