"""Serving a build on Triton Inference Server: the model repository export and the serving module its models use."""
