"""The `dlts` platform: a job per trial on DLTS (Microsoft's DLWorkspace)."""
