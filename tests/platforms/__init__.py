"""Each platform beyond the conformance suite, the simulators and hosts they run on, and what trials see."""
