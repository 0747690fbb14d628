"""The relational store: schema (tables), engines, migrations."""
