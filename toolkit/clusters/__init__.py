"""Launching beyond one machine on the engines teams run: Ray Train, Kubernetes (Kubeflow Trainer), SkyPilot."""
