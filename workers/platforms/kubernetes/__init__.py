"""What the two Kubernetes platforms, `kubeflow` and `frameworkcontroller` (one folder each, below), share."""
