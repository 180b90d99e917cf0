"""The `kubeflow` platform: a TFJob or PyTorchJob per trial (Kubeflow's training operator)."""
