"""Framework adapters. Import each one directly; none is imported by the package root."""
