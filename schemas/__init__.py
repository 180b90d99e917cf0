"""Pydantic models: events, trial views, forms and configs. No I/O lives here."""
