"""Adapters for inference engines. All knowledge of a given engine lives in its subpackage."""
