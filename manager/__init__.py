"""Control plane: event store, projector, TrainingService, runner and CLI."""
