"""The `remote` platform: trials on SSH hosts, followed from the worker."""
