"""nexus-sli client (tritonclient over HTTP/gRPC). The typed client API is not written yet: see the README."""
