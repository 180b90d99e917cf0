"""The event log, the schemas and their upcasters, and settings: what everything else stands on."""
