"""The trialstream command as a user runs it."""
