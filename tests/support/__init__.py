"""What the tests share: the simulators' fixtures, config writers, workers, the conformance suite, the stack."""
