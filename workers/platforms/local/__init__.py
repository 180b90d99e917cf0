"""The `local` platform: trials as processes on the worker's machine."""
