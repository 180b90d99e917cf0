"""Platform adapters executed by RQ workers, one queue per platform."""
