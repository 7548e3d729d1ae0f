"""Code that runs inside the Triton server's python backend.

These modules need only numpy and tokenizers, so the export copies them into
the model repository as they are; the exporter imports the same functions for
validation, so what is validated is what is served.
"""
