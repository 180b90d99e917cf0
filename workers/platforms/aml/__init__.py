"""The `aml` platform: a command job per trial in an Azure Machine Learning workspace."""
