"""Example workloads for remesh; each subpackage is a training job the elastic trainer can run."""
