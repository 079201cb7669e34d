"""Configuration (PURE): the model, the value parsers, the section tables, the YAML reader."""
