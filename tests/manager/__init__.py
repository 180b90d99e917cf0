"""The manager: the projection and projector, tuners, config, runner, resume and the training service."""
