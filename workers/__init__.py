"""The worker side: the RQ runtime that runs trials (`workers.runtime`) and the platforms it runs them on
(`workers.platforms`, one folder each)."""
